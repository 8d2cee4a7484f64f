"""python -m runtime.bench [--quick] [--json PATH] [--plot FILE.png]: memory and speed at real vocabulary sizes.

Every figure is a ratio to a baseline measured in the same run (numpy take, numpy matmul, an in-run
SGEMM and memcpy rate, the table's own bytes), so it means the same on a loaded machine. Times are
the minimum over repeats (noise only ever adds time). Progress goes to stderr, the table to stdout.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import graphs
from embed import OneLineParser  # argparse with one-line errors, exit 2
from runtime.runner import session_options

WIDTH = 768


def progress(message):
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def race(fns, budget):
    """Seconds per call of each function: the minimum over 5 rounds, the contenders interleaved in every
    round, so a slow spell on this shared machine hits all of them rather than one (noise only adds time)."""
    loops = {}
    for name, fn in fns.items():
        fn()  # warm: first-run allocations and page faults are not the steady state
        start = time.perf_counter()
        fn()
        loops[name] = max(1, int(budget / 5 / len(fns) / max(time.perf_counter() - start, 1e-7)))
    best = dict.fromkeys(fns, math.inf)
    for _ in range(5):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(loops[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / loops[name])
    return best


def best_time(fn, budget):
    return race({"fn": fn}, budget)["fn"]


def session(model, prepacking=False, arena=False):
    options = session_options(prepacking=prepacking, arena=arena)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def bound_run(sess, feeds, outputs):
    """A zero-copy run: inputs and preallocated outputs bound once, as a serving loop would."""
    binding = sess.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for name, value in outputs.items():
        binding.bind_output(name, "cpu", 0, value.dtype, value.shape, value.ctypes.data)
    keep = (feeds, outputs)  # onnxruntime holds raw pointers into these arrays: they must outlive the binding
    return lambda: sess.run_with_iobinding(binding) or keep


# --- a, b: lookups ---------------------------------------------------------------------------------------

def bench_lookups(vocabs, tokens, budget):
    rows = []
    rng = np.random.default_rng(0)
    for vocab in vocabs:
        table = graphs.make_table(vocab, WIDTH)
        ids = rng.integers(0, vocab, size=(1, tokens), dtype=np.int64)
        out = np.empty((1, tokens, WIDTH), np.float32)
        gather_session = session(graphs.gather_lookup(table))
        times = race({"take": lambda: np.take(table, ids, axis=0, out=out),
                      "gather": bound_run(gather_session, {"ids": ids}, {"embeddings": out})}, budget)
        take, gather = times["take"], times["gather"]
        onehot = best_time(bound_run(session(graphs.onehot_lookup(table)), {"ids": ids}, {"embeddings": out}), budget)
        rows.append({"vocab": vocab, "tokens": tokens, "take_s": take, "gather_s": gather, "onehot_s": onehot,
                     "gather_vs_take": gather / take, "onehot_vs_gather": onehot / gather,
                     "onehot_multiplications": tokens * vocab * WIDTH})
        progress(f"lookup V={vocab} n={tokens}: Gather {gather * 1e6:.0f} us, take {take * 1e6:.0f} us, "
                 f"OneHot+MatMul {onehot * 1e3:.1f} ms")
    return rows


# --- c: the tied head ------------------------------------------------------------------------------------

def sgemm_baseline():
    """(FLOP per call, call): numpy's SGEMM on a square problem big enough to run at the machine's rate."""
    a = np.random.default_rng(1).standard_normal((2048, 2048)).astype(np.float32)
    out = np.empty_like(a)
    return 2 * 2048**3, lambda: np.matmul(a, a, out=out)


def memcpy_baseline():
    """(bytes per call, call): numpy copying a 256 MiB buffer (bytes copied, each read once and written once)."""
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    return src.nbytes, lambda: np.copyto(dst, src)


def bench_head(vocab, counts, budget):
    """The tied head against numpy, with the SGEMM and memcpy baselines raced in the same rounds."""
    sgemm_flops, sgemm = sgemm_baseline()
    memcpy_bytes, memcpy = memcpy_baseline()
    table = graphs.make_table(vocab, WIDTH)
    model = graphs.tied_logits(table)
    sessions = {"runner": session(model), "prepacking": session(model, prepacking=True),
                "arena": session(model, arena=True)}
    rows = []
    for n in counts:
        hidden = np.random.default_rng(n).standard_normal((1, n, WIDTH)).astype(np.float32)
        ids = np.zeros((1, 1), np.int64)
        logits = np.empty((1, n, vocab), np.float32)
        flat = hidden.reshape(n, WIDTH)
        contenders = {"numpy": lambda: np.matmul(flat, table.T, out=logits.reshape(n, vocab)), "sgemm": sgemm}
        if n == 1:
            contenders["memcpy"] = memcpy
        for label, sess in sessions.items():
            contenders[label] = bound_run(sess, {"ids": ids, "hidden": hidden},
                                          {"embeddings": np.empty((1, 1, WIDTH), np.float32), "logits": logits})
        times = race(contenders, 4 * budget)
        numpy_s = times["numpy"]
        flops = 2 * n * vocab * WIDTH
        rows.append({"tokens": n, "vocab": vocab, "ort_s": times["runner"], "numpy_s": numpy_s,
                     "sgemm_flop_per_s": sgemm_flops / times["sgemm"],
                     "memcpy_bytes_per_s": memcpy_bytes / times["memcpy"] if n == 1 else None,
                     "prepacking_s": times["prepacking"], "arena_s": times["arena"],
                     "flop_per_s": flops / times["runner"], "table_bytes_per_s": table.nbytes / times["runner"],
                     "vs_numpy": times["runner"] / numpy_s, "prepacking_off_cost": times["runner"] / times["prepacking"],
                     "arena_off_cost": times["runner"] / times["arena"]})
        progress(f"tied head V={vocab} N={n}: {times['runner'] * 1e3:.2f} ms (prepacking on "
                 f"{times['prepacking'] * 1e3:.2f} ms, arena on {times['arena'] * 1e3:.2f} ms), numpy "
                 f"{numpy_s * 1e3:.2f} ms")
    return rows


# --- d: memory -------------------------------------------------------------------------------------------

_PROBE = """
import sys, numpy as np
from runtime.runner import Runner
def rss():
    return int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) * 1024
before = rss()
runner = Runner(sys.argv[1], arena=sys.argv[3] == 'arena')
start = rss()
runner.run({'ids': np.zeros((1, 3), np.int64), 'hidden': np.ones((1, 64, int(sys.argv[2])), np.float32)})
print(start - before, rss() - before)
"""


def bench_memory(sizes, folder):
    """Resident bytes a session adds, per table byte, each model in a fresh process (Runner's settings)."""
    rows = []
    for vocab, width in sizes:
        table, head = graphs.make_table(vocab, width), graphs.make_table(vocab, width, seed=1)
        # the Runner's settings for every layout, then the tied head once more with the arena on, to show its price
        cases = [(tied, external, False) for tied in (True, False) for external in (False, True)] + [(True, True, True)]
        for tied, external, arena in cases:
            model = graphs.tied_logits(table) if tied else graphs.untied_logits(table, head)
            path = os.path.join(folder, f"m_{vocab}_{tied}_{external}.onnx")
            written = graphs.save(model, path, external=external, overwrite=True)
            done = subprocess.run([sys.executable, "-c", _PROBE, path, str(width), "arena" if arena else "-"],
                                  capture_output=True, text=True, check=True)
            start, after = map(int, done.stdout.split())
            rows.append({"vocab": vocab, "width": width, "tied": tied, "external": external, "arena": arena,
                         "table_bytes": table.nbytes, "at_start": start / table.nbytes,
                         "after_first_run": after / table.nbytes, "target": 1.10 if tied else 2.10})
            progress(f"memory V={vocab} D={width} {'tied' if tied else 'untied'} "
                     f"{'external' if external else 'inline'}{', arena on' if arena else ''}: "
                     f"{start / table.nbytes:.2f}x at start, {after / table.nbytes:.2f}x after the first run")
            for p in written:
                os.remove(p)
        del table, head
    return rows


# --- e: the floor ----------------------------------------------------------------------------------------

def bench_floor(budget):
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "floor",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    sess = session(model)
    x = np.ones(1, np.float32)
    times = race({"run": lambda: sess.run(None, {"x": x}),
                  "bound": bound_run(sess, {"x": x}, {"y": np.empty(1, np.float32)})}, budget)
    plain, bound = times["run"], times["bound"]
    progress(f"overhead floor: run {plain * 1e6:.1f} us, run_with_iobinding {bound * 1e6:.1f} us")
    return {"run_s": plain, "iobinding_s": bound}


# --- report ----------------------------------------------------------------------------------------------

def report(results):
    lines = [f"machine: {os.cpu_count()} cores; onnxruntime {ort.__version__}, numpy {np.__version__}", "",
             "a/b. lookups, width 768 (Gather and OneHot+MatMul through io_binding into a preallocated output)",
             f"{'V':>8} {'n':>6} {'take us':>9} {'Gather us':>10} {'Gather/take':>12} {'OneHot ms':>10} "
             f"{'OneHot/Gather':>14} {'n*V*D mults':>14}"]
    for r in results["lookups"]:
        lines.append(f"{r['vocab']:>8} {r['tokens']:>6} {r['take_s'] * 1e6:>9.1f} {r['gather_s'] * 1e6:>10.1f} "
                     f"{r['gather_vs_take']:>12.2f} {r['onehot_s'] * 1e3:>10.2f} {r['onehot_vs_gather']:>14.0f} "
                     f"{r['onehot_multiplications']:>14.3g}")
    lines += ["", "c. tied logits, V = %d, width 768; ORT = Runner settings (prepacking off, arena off); the "
              "last two columns time the same session with one setting flipped; SGEMM = numpy 2048^3 and memcpy = "
              "numpy copyto of 256 MiB, raced in the same rounds" % results["head"][0]["vocab"],
              f"{'N':>5} {'numpy ms':>9} {'ORT ms':>8} {'ORT/numpy':>10} {'GFLOP/s':>8} {'SGEMM':>6} {'of SGEMM':>9} "
              f"{'of memcpy':>10} {'prepack on ms':>14} {'arena on ms':>12}"]
    for r in results["head"]:
        sgemm = r["flop_per_s"] / r["sgemm_flop_per_s"]
        memcpy = f"{r['table_bytes_per_s'] / r['memcpy_bytes_per_s']:.0%}" if r["memcpy_bytes_per_s"] else "-"
        lines.append(f"{r['tokens']:>5} {r['numpy_s'] * 1e3:>9.2f} {r['ort_s'] * 1e3:>8.2f} {r['vs_numpy']:>10.2f} "
                     f"{r['flop_per_s'] / 1e9:>8.1f} {r['sgemm_flop_per_s'] / 1e9:>6.0f} {sgemm:>9.0%} {memcpy:>10} "
                     f"{r['prepacking_s'] * 1e3:>14.2f} {r['arena_s'] * 1e3:>12.2f}")
    lines += ["", "d. resident memory a session adds, per table byte (fresh process each; first run: 64 tokens)",
              f"{'V x D':>14} {'head':>7} {'file':>9} {'arena':>6} {'at start':>9} {'after run':>10} {'target':>7}"]
    for r in results["memory"]:
        verdict = "met" if r["after_first_run"] <= r["target"] else "NOT met"
        verdict = f"({'within' if verdict == 'met' else 'over'}; shown for the arena's price)" if r["arena"] else verdict
        lines.append(f"{r['vocab']:>7} x {r['width']:<4} {'tied' if r['tied'] else 'untied':>7} "
                     f"{'external' if r['external'] else 'inline':>9} {'on' if r['arena'] else 'off':>6} "
                     f"{r['at_start']:>8.2f}x {r['after_first_run']:>9.2f}x {'<= %.2fx' % r['target']:>9} {verdict}")
    floor = results["floor"]
    lines += ["", f"e. per-run floor (Identity on one float): run {floor['run_s'] * 1e6:.1f} us, "
                  f"run_with_iobinding {floor['iobinding_s'] * 1e6:.1f} us", "", "targets:"]
    lines += [f"  {'met    ' if ok else 'NOT met'}  {what}" for what, ok in targets(results)]
    return "\n".join(lines)


def targets(results):
    """[(target, met)] from the figures of this run."""
    memory = results["memory"]
    big_head = [r for r in results["head"] if r["tokens"] >= 64]
    share = lambda r: r["flop_per_s"] / r["sgemm_flop_per_s"]
    return [
        ("tied <= 1.10x table bytes after the first run, every size and file layout (Runner settings)",
         all(r["after_first_run"] <= 1.10 for r in memory if r["tied"] and not r["arena"])),
        ("untied <= 2.10x table bytes after the first run", all(r["after_first_run"] <= 2.10 for r in memory
                                                                 if not r["tied"])),
        ("Gather no slower than numpy take(out=) at n >= 256",
         all(r["gather_vs_take"] <= 1 for r in results["lookups"] if r["tokens"] >= 256)),
        ("tied logits >= 85%% of the in-run SGEMM rate at N >= 64 (%s)" %
         ", ".join(f"N={r['tokens']}: {share(r):.0%}" for r in big_head), all(share(r) >= 0.85 for r in big_head)),
        ("tied logits no slower than numpy at N >= 64 (%s)" %
         ", ".join(f"N={r['tokens']}: {r['vs_numpy']:.2f}x" for r in big_head), all(r["vs_numpy"] <= 1 for r in big_head)),
    ]


def plot(results, path):
    """Two panels of same-run ratios; matplotlib is optional, so it is imported only here (main checks first)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    vocabs = [r["vocab"] for r in results["lookups"]]
    left.loglog(vocabs, [r["onehot_vs_gather"] for r in results["lookups"]], "o-", label="OneHot+MatMul / Gather")
    left.loglog(vocabs, [r["gather_vs_take"] for r in results["lookups"]], "s-", label="Gather / numpy take")
    left.set_xlabel("vocabulary size V (width 768)")
    left.set_ylabel("time ratio, same run")
    left.legend()
    counts = [r["tokens"] for r in results["head"]]
    for key, style, label in (("ort_s", "o-", "ORT tied head (Runner settings)"), ("numpy_s", "s-", "numpy matmul"),
                              ("arena_s", "^--", "ORT, arena on")):
        right.semilogx(counts, [r["flop_per_s"] * r["ort_s"] / r[key] / r["sgemm_flop_per_s"] for r in results["head"]],
                       style, label=label)
    right.set_xlabel("tokens N")
    right.set_ylabel("share of the in-run SGEMM rate")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = OneLineParser(prog="python -m runtime.bench", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("--quick", action="store_true", help="smaller sweep, under a minute")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="plot the ratios (needs matplotlib)")
    args = parser.parse_args(argv)
    for target in (args.json, args.plot):
        if target and not os.path.isdir(os.path.dirname(os.path.abspath(target))):
            parser.error(f"{target}: no such folder")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail before minutes of measuring, not after)
        except ImportError:
            parser.error("--plot needs matplotlib, which is optional: ./lab_env/python -m pip install matplotlib")
    budget = 0.1 if args.quick else 0.5
    vocabs = [8192, 131072] if args.quick else [1024, 8192, 32768, 131072]
    sizes = [(50257, 768)] if args.quick else [(50257, 768), (128256, 1024)]
    results = {"quick": args.quick, "onnxruntime": ort.__version__, "numpy": np.__version__, "cores": os.cpu_count()}
    results["lookups"] = bench_lookups(vocabs, 256, budget)
    results["head"] = bench_head(50257, [1, 64, 512], budget)
    with tempfile.TemporaryDirectory(prefix="onnx-lab-bench-") as folder:
        results["memory"] = bench_memory(sizes, folder)
    results["floor"] = bench_floor(budget)
    print(report(results))
    if args.json:
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(args.json)), delete=False,
                                         suffix=".json") as f:
            json.dump(results, f, indent=2)
        os.replace(f.name, args.json)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
