"""The command: parse, run each section, print the report, write JSON, Markdown and the plot."""
import datetime
import json
import os
import shlex
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort

import embed
from embed import OneLineParser  # argparse with one-line errors, exit 2
from graphs.outputs import check_output, write_text
from runtime.bench import markdown, page
from runtime.bench.formats import bench_formats
from runtime.bench.head import bench_floor, bench_head
from runtime.bench.lookups import bench_format_lookups, bench_lookups, bench_packed_rows
from runtime.bench.memory import bench_memory
from runtime.bench.scale import bench_scale
from runtime.bench.summary import plot, plot_formats, report
from runtime.bench.timing import stage


def _parser():
    parser = OneLineParser(prog="python -m runtime.bench", description=(
        "Memory and speed at real vocabulary sizes, every figure a ratio to a baseline timed in the same run: "
        "a/b Gather against numpy's take and OneHot+MatMul; b' the lookup at every format (the median of seven "
        "same-round ratios, spread printed); b'' the int4 lookup two ways; c the tied head through Runner.run "
        "against numpy's best matmul; d resident memory a session adds; d' the memory meeting (every format, and "
        "bfloat16 with constant folding off, at three sizes: bytes, resident, ms per token and per 64 tokens, "
        "against numpy and the byte floor, accuracy); e the per-run floor. Progress on stderr, the report on "
        "stdout, then the targets met or not. The full sweep takes about 50 minutes on 2 cores, --quick a few."))
    parser.add_argument("--quick", action="store_true", help="smaller sweep (GPT-2's size only), a few minutes")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="also write the figures as Markdown tables, each with the "
                        "date and machine of the run: into the <!-- bench:NAME --> ... <!-- /bench --> regions of "
                        "FILE if it exists (BENCHMARKS.md), else a new file holding every table")
    parser.add_argument("--scale", metavar="GIB", type=float, nargs="+", help="also f: inspect, --static and "
                        "--retie on generated tied models of these sizes (a few big blocks, and transformer-like layers), each a "
                        "ratio to a plain session of the same model (runtime.bench.scale; 3 and 8 GiB take about 10 minutes here, and twice the largest "
                        "size on disk)")
    parser.add_argument("--plot", metavar="FILE.png", help="plot the ratios, and the memory meeting beside it as "
                        "FILE_formats.png (needs matplotlib)")
    return parser


def _check_outputs(parser, args):
    """Refuse a bad --json / --markdown / --plot before an hour of measuring, not after it."""
    try:
        for flag, target in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
            if target is not None:
                check_output(target, flag)
        if args.markdown is not None:
            markdown.check_target(args.markdown)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        parser.error(str(e))
    if args.scale and any(not 0 < gib <= 64 for gib in args.scale):
        parser.error("--scale: each size must be in (0, 64] GiB")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail before minutes of measuring, not after)
        except ImportError:
            parser.error("--plot needs matplotlib, which is optional: ./lab_env/python -m pip install matplotlib")


def about(quick):
    """The run's date (UTC) and machine: what every figure of it is to be read with."""
    return {"quick": quick, "onnxruntime": ort.__version__, "numpy": np.__version__, "cores": os.cpu_count(),
            "cpu": page.cpu(), "memory_bytes": embed.physical_memory() or 0,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")}


def _measure(quick, scale_gib=()):
    """Every section's figures, and the run's date and machine; `scale_gib`: the sizes of section f."""
    budget = 0.1 if quick else 0.5
    vocabs = [8192, 131072] if quick else [1024, 8192, 32768, 131072]
    sizes = [(50257, 768)] if quick else [(50257, 768), (128256, 1024)]
    heads = [(50257, 768)] if quick else [(50257, 768), (128256, 4096)]
    results = about(quick)
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
        formats = [(50257, 768)] if quick else [(50257, 768), (151936, 896), (128256, 4096)]
        stage("d': every format's head: bytes, resident, time per token")
        results["formats"] = bench_formats(formats, budget, folder)
    stage("e: the per-run floor")
    results["floor"] = bench_floor(budget)
    if scale_gib:
        stage("f: inspect and --retie at the sizes people ship")
        results["scale"] = bench_scale(scale_gib) + bench_scale(scale_gib, "layered")  # and as exports are shaped
    stage()
    return results


def write_markdown(path, results):
    """--markdown: the regions of an existing file rewritten, or a new file of every table."""
    text = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    write_text(path, markdown.render(results, text))


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    _check_outputs(parser, args)
    started = time.monotonic()
    results = _measure(args.quick, args.scale or ())
    results["seconds"] = time.monotonic() - started
    results["command"] = " ".join(["python -m runtime.bench", shlex.join(sys.argv[1:] if argv is None else argv)]).strip()
    print(report(results))
    if args.json:
        write_text(args.json, json.dumps(results, indent=2))
    if args.markdown:
        write_markdown(args.markdown, results)
    if args.plot:
        plot(results, args.plot)
        if results.get("formats"):
            plot_formats(results["formats"], os.path.splitext(args.plot)[0] + "_formats.png")
    return 0
