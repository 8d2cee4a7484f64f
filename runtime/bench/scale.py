"""inspect at the sizes people ship: `python -m runtime.bench.scale [--gib 3 8] [--form torchscript|shared]`.

For each size, a tied model is generated on disk (runtime.bench.scale_model) and each command is run in a fresh
process tree whose summed Pss (/proc/PID/smaps_rollup of every process in it, so pages several of them map count
once each) is sampled every 0.1 s: a plain session under onnxruntime's default SessionOptions (load and one run:
the baseline), `inspect MODEL`, `inspect MODEL --static`, `inspect MODEL --retie OUT` and (the TorchScript
form) `inspect MODEL --retie OUT --logits-to-keep 1`. Printed: each command's
wall time and peak as ratios to the baseline of the same run, and the issue's targets met or not. The models
are written to a scratch folder (--scratch DIR chooses where) and removed after.

`--model PATH [PATH ...]` measures models you exported instead, the same way (runtime.bench.real_models), and
--markdown then writes the `scale_real` region; `--repeat N` runs its commands N times over, in turn, and gives
each figure's median."""
import argparse
import datetime
import importlib.metadata
import os
import shutil
import sys
import tempfile

from runtime.bench import page
from runtime.bench.measure import measure
from runtime.bench.scale_model import FORMS, blocks_for, generate

TARGETS = {"inspect": (2.5, 1.3), "static": (0.5, None), "retie": (5.0, 1.5),
           "keep": (5.0, 1.5)}  # (time, peak) x the plain session; keep: --retie OUT --logits-to-keep 1
LABELS = {"keep": "retie --logits-to-keep 1"}  # the table's name for a command, where not its key

_SESSION = """
import sys, numpy as np, onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
ids = np.arange(8, dtype=np.int64)  # [tokens] for the shared form, [batch, sequence] for the TorchScript one
session.run(None, {"input_ids": ids if len(session.get_inputs()[0].shape) == 1 else ids.reshape(1, 8)})
"""


def run_size(gib, form, where, **dims):
    """Every command's figures for one size: {size_bytes, baseline, inspect, static, retie, and keep for the
    TorchScript form}. `dims`: vocab, width, hidden for generate (default: Llama 3's vocabulary at a 1B model's
    widths)."""
    path = os.path.join(where, "model.onnx")
    written = generate(path, blocks_for(gib, form=form, **dims), form=form, **dims)
    inspect = [sys.executable, "-m", "runtime.inspect", path]
    figures = {"size_bytes": written, "baseline": measure([sys.executable, "-c", _SESSION, path])}
    figures["inspect"] = measure(inspect)
    figures["static"] = measure(inspect + ["--static"])
    out = os.path.join(where, "out.onnx")
    figures["retie"] = measure(inspect + ["--retie", out])
    if form != "shared":  # [batch, sequence] in, logits per position out: a head --logits-to-keep slices
        for name in [n for n in os.listdir(where) if n.startswith("out.onnx")]:
            os.remove(os.path.join(where, name))
        figures["keep"] = measure(inspect + ["--retie", out, "--logits-to-keep", "1"])
    for name in os.listdir(where):
        os.remove(os.path.join(where, name))
    return figures


def _judged(figures):
    """(command, its figures, time ratio, peak ratio, met) for each command of TARGETS, against the baseline."""
    base = figures["baseline"]
    for name, (most_time, most_peak) in TARGETS.items():
        if name not in figures:
            continue
        f = figures[name]
        t, p = f["wall_s"] / base["wall_s"], f["peak_bytes"] / max(1, base["peak_bytes"])
        yield name, f, t, p, t <= most_time and (most_peak is None or p <= most_peak) and f["status"] == 0


def lines(figures):
    """The report's lines for one size: each command, its ratios, its target."""
    base = figures["baseline"]
    yield (f"{figures['size_bytes'] / 2**30:.2f} GiB: plain session (load + one run) {base['wall_s']:.1f} s, "
           f"peak {base['peak_bytes'] / 2**30:.2f} GiB Pss")
    for name, f, t, p, met in _judged(figures):
        most_time, most_peak = TARGETS[name]
        target = f"<= {most_time}x time" + (f", <= {most_peak}x peak" if most_peak else "")
        yield (f"  {name:<8} {f['wall_s']:6.1f} s = {t:4.2f}x, peak {f['peak_bytes'] / 2**30:5.2f} GiB = {p:4.2f}x "
               f"(target {target}): {'met' if met else 'NOT met'}"
               + (f"; exit {f['status']}: {f['error']}" if f["status"] not in (0, 1) else ""))


def bench_scale(sizes, form="torchscript", scratch=None):
    """Section f of runtime.bench: run_size's figures at each of `sizes` (GiB), in a scratch folder removed after."""
    where = tempfile.mkdtemp(prefix="onnx-lab-scale-", dir=scratch)
    try:
        return [dict(run_size(gib, form, where), gib=gib, form=form) for gib in sizes]
    finally:
        shutil.rmtree(where, ignore_errors=True)


def targets(figures):
    """[(target, met)] of one size's figures: each command's ratios against TARGETS, and its exit status."""
    found = []
    for name, _, t, p, met in _judged(figures):
        most_time, most_peak = TARGETS[name]
        found.append((f"{figures['size_bytes'] / 2**30:.2f} GiB: {name} <= {most_time}x a plain session's time"
                      + (f", <= {most_peak}x its peak Pss" if most_peak else "")
                      + f" ({t:.2f}x" + (f", {p:.2f}x" if most_peak else "") + ")", met))
    return found


def markdown_table(results):
    """The Markdown rows of section f (BENCHMARKS.md's `scale` region): each command's figures and ratios."""
    rows = []
    for f in results.get("scale") or ():
        base = f["baseline"]
        rows.append([f"{f['size_bytes'] / 2**30:.2f} GiB {f.get('form', 'torchscript')}", "plain session",
                     f"{base['wall_s']:.1f} s", "1x", f"{base['peak_bytes'] / 2**30:.2f} GiB", "1x"])
        for name in [n for n in TARGETS if n in f]:
            c, label = f[name], LABELS.get(name, name)
            rows.append(["", label if c["status"] == 0 else f"{label} (exit {c['status']})", f"{c['wall_s']:.1f} s",
                         f"{c['wall_s'] / base['wall_s']:.2f}x", f"{c['peak_bytes'] / 2**30:.2f} GiB",
                         f"{c['peak_bytes'] / max(1, base['peak_bytes']):.2f}x"])
    return page.table(["model", "command", "wall", "x session", "peak Pss", "x session"], rows or [["not measured"] * 6])


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m runtime.bench.scale", description=__doc__)
    parser.add_argument("--gib", type=float, nargs="+", default=[3.0], help="model sizes in GiB (default 3)")
    parser.add_argument("--form", choices=FORMS, default="torchscript")
    parser.add_argument("--scratch", metavar="DIR", help="where the models are written (default: TMPDIR)")
    parser.add_argument("--model", metavar="PATH", nargs="+", help="measure these exported models (files or the "
                        "folders a client loads) instead of generated ones: runtime.bench.real_models")
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="with --model: run the commands N times "
                        "over, in turn, and give each figure's median (default 1)")
    parser.add_argument("--markdown", metavar="FILE", help="also rewrite the <!-- bench:scale --> region of FILE "
                        "(BENCHMARKS.md; <!-- bench:scale_real --> with --model) with this run's table")
    args = parser.parse_args(argv)
    if args.model:
        return _models(parser, args)
    if any(not 0 < gib <= 64 for gib in args.gib):
        parser.error("--gib: each size must be in (0, 64] GiB")
    if args.markdown:
        page.region_or_exit(parser, args.markdown, "scale")
    started = datetime.datetime.now(datetime.timezone.utc)
    figures = []
    for gib in args.gib:
        figures += bench_scale([gib], args.form, args.scratch)
        for line in lines(figures[-1]):
            print(line, flush=True)
    if args.markdown:
        run = {"scale": figures, "date": started.strftime("%Y-%m-%d %H:%M"), "cpu": page.cpu(),
               "cores": os.cpu_count(), "onnxruntime": importlib.metadata.version("onnxruntime")}
        page.rewrite_region(args.markdown, "scale", "\n".join(markdown_table(run)) + "\n\n" + page.stamp(run)
                            + "\n")


def _models(parser, args):
    """main's --model branch: each model measured by real_models, its lines printed, then the region written."""
    from runtime.bench import real_models
    missing = [p for p in args.model if not os.path.exists(p)]
    if missing:
        parser.error(f"--model: no such file or folder: {missing[0]}")
    if not 1 <= args.repeat <= 99:
        parser.error("--repeat: from 1 to 99")
    if args.markdown:
        page.region_or_exit(parser, args.markdown, "scale_real")
    started = datetime.datetime.now(datetime.timezone.utc)
    figures = []
    for path in args.model:
        figures.append(real_models.measure_model(path, args.scratch, args.repeat))
        for line in real_models.lines(figures[-1]):
            print(line, flush=True)
    if args.markdown:
        run = {"date": started.strftime("%Y-%m-%d %H:%M"), "cpu": page.cpu(), "cores": os.cpu_count(),
               "onnxruntime": importlib.metadata.version("onnxruntime")}
        medians = f"*each figure the median of {args.repeat} runs, taken in turn*\n" if args.repeat > 1 else ""
        page.rewrite_region(args.markdown, "scale_real", "\n".join(real_models.markdown_table(figures)) + "\n\n"
                            + medians + page.stamp(run) + "\n")
    return 0


if __name__ == "__main__":
    main()
