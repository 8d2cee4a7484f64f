"""The command: parse, run each section, print the report, write JSON and the plot."""
import json
import os
import tempfile

import numpy as np
import onnxruntime as ort

from embed import OneLineParser  # argparse with one-line errors, exit 2
from graphs.storage import check_output, write_text
from runtime.bench.head import bench_floor, bench_head
from runtime.bench.formats import bench_formats
from runtime.bench.lookups import bench_format_lookups, bench_lookups, bench_packed_rows
from runtime.bench.memory import bench_memory
from runtime.bench.report import plot, plot_formats, report
from runtime.bench.timing import stage


def main(argv=None):
    parser = OneLineParser(prog="python -m runtime.bench", description=(
        "Memory and speed at real vocabulary sizes, every figure a ratio to a baseline timed in the same run: "
        "a/b Gather against numpy's take and OneHot+MatMul; b' the lookup at every format (the median of seven "
        "same-round ratios, spread printed); b'' the int4 lookup two ways; c the tied head through Runner.run "
        "against numpy's best matmul; d resident memory a session adds; d' the memory meeting (every format, and "
        "bfloat16 with constant folding off, at three sizes: bytes, resident, ms per token and per 64 tokens, "
        "against numpy and the byte floor, accuracy); e the per-run floor. Progress on stderr, the report on "
        "stdout, then the targets met or not."))
    parser.add_argument("--quick", action="store_true", help="smaller sweep (GPT-2's size only), a few minutes")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="plot the ratios, and the memory meeting beside it as "
                        "FILE_formats.png (needs matplotlib)")
    args = parser.parse_args(argv)
    for flag, target in (("--json", args.json), ("--plot", args.plot)):
        try:
            if target is not None:  # before an hour of measuring, not after it
                check_output(target, flag)
        except ValueError as e:
            parser.error(str(e))
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail before minutes of measuring, not after)
        except ImportError:
            parser.error("--plot needs matplotlib, which is optional: ./lab_env/python -m pip install matplotlib")
    budget = 0.1 if args.quick else 0.5
    vocabs = [8192, 131072] if args.quick else [1024, 8192, 32768, 131072]
    sizes = [(50257, 768)] if args.quick else [(50257, 768), (128256, 1024)]
    heads = [(50257, 768)] if args.quick else [(50257, 768), (128256, 4096)]
    results = {"quick": args.quick, "onnxruntime": ort.__version__, "numpy": np.__version__, "cores": os.cpu_count()}
    stage("a/b: Gather against numpy's take and OneHot+MatMul")
    results["lookups"] = bench_lookups(vocabs, 256, budget)
    stage("b': the lookup at every format, small and large vocabulary")
    results["format_lookups"] = bench_format_lookups([1024, 131072], 256, budget)
    stage("b'': the int4 lookup two ways")
    results["packed_rows"] = bench_packed_rows(131072, [1, 256], budget)
    with tempfile.TemporaryDirectory(prefix="onnx-lab-bench-") as folder:
        stage("c: the tied head through Runner.run against numpy's best matmul")
        results["head"] = bench_head(heads, [1, 64, 512], budget, folder)
        stage("d: resident memory a session adds")
        results["memory"] = bench_memory(sizes, folder)
        formats = [(50257, 768)] if args.quick else [(50257, 768), (151936, 896), (128256, 4096)]
        stage("d': every format's head: bytes, resident, time per token")
        results["formats"] = bench_formats(formats, budget, folder)
    stage("e: the per-run floor")
    results["floor"] = bench_floor(budget)
    stage()
    print(report(results))
    if args.json:
        write_text(args.json, json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)
        if results.get("formats"):
            plot_formats(results["formats"], os.path.splitext(args.plot)[0] + "_formats.png")
    return 0
