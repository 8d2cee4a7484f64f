"""The bench's report: one section per measurement, then the targets, each met or not with its figures."""
import os

import numpy as np
import onnxruntime as ort


def report(results):
    lines = [f"machine: {os.cpu_count()} cores; onnxruntime {ort.__version__}, numpy {np.__version__}", "",
             "a/b. lookups, width 768 (Gather and OneHot+MatMul through io_binding into a preallocated output)",
             f"{'V':>8} {'n':>6} {'take us':>9} {'Gather us':>10} {'Gather/take':>12} {'OneHot ms':>10} "
             f"{'OneHot/Gather':>14} {'n*V*D mults':>14}"]
    for r in results["lookups"]:
        lines.append(f"{r['vocab']:>8} {r['tokens']:>6} {r['take_s'] * 1e6:>9.1f} {r['gather_s'] * 1e6:>10.1f} "
                     f"{r['gather_vs_take']:>12.2f} {r['onehot_s'] * 1e3:>10.2f} {r['onehot_vs_gather']:>14.0f} "
                     f"{r['onehot_multiplications']:>14.3g}")
    if results.get("format_lookups"):
        vocabs = list(results["format_lookups"][0]["seconds"])
        lines += ["", f"b'. the lookup at every format, {results['format_lookups'][0]['tokens']} ids, width 768: "
                  "time at each vocabulary, raced in the same rounds (it should follow the ids, not the table)",
                  f"{'format':>10} " + " ".join(f"{'V=' + v + ' us':>13}" for v in vocabs) + f" {'large/small':>12}"]
        for r in results["format_lookups"]:
            lines.append(f"{r['format']:>10} " + " ".join(f"{r['seconds'][v] * 1e6:>13.1f}" for v in vocabs)
                         + f" {r['large_vs_small']:>12.2f}")
    floor = results["floor"]
    lines += ["", "c. the tied head through Runner.run (the default path, and with out= buffers) against numpy's best "
              "2-D matmul on the same table, numpy in a child process with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE "
              "unset; the last two columns (ms) show where the time goes, each at a price in memory: the head reading a "
              "second, prepacked copy of the table (the untied graph on the same values), and the tied model with the "
              f"arena on; per-run floor: run {floor['run_s'] * 1e6:.0f} us, io_binding {floor['iobinding_s'] * 1e6:.0f} us",
              f"{'V x D':>14} {'N':>5} {'numpy ms':>9} {'kernel':>9} {'run ms':>8} {'run/numpy':>10} "
              f"{'out= ms':>8} {'out=/numpy':>11} {'GFLOP/s':>8} {'packed copy':>11} {'arena on':>9}"]
    for r in results["head"]:
        lines.append(f"{r['vocab']:>7} x {r['width']:<4} {r['tokens']:>5} {r['numpy_s'] * 1e3:>9.2f} {r['kernel']:>9} "
                     f"{r['run_s'] * 1e3:>8.2f} {r['run_vs_numpy']:>10.2f} {r['run_out_s'] * 1e3:>8.2f} "
                     f"{r['run_out_vs_numpy']:>11.2f} {r['flop_per_s'] / 1e9:>8.1f} {r['packed_copy_s'] * 1e3:>11.2f} "
                     f"{r['arena_on_s'] * 1e3:>9.2f}"
                     + (f"  (per-run floor {floor['iobinding_s'] * 1e3:.3f} ms)" if r["tokens"] == 1 else ""))
        if r["run_vs_numpy"] > 1:
            lines.append(f"{'':>14} over numpy by {r['run_vs_numpy']:.2f}x: " + _why(r))
        if "memory" in r:
            m = r["memory"]
            lines.append(f"{'':>14} resident after N={r['tokens']} runs: {m['grown'] / 2**20:.0f} MiB = {m['ratio']:.2f}x "
                         f"(table {m['table_bytes'] / 2**20:.0f} MiB + logits returned {m['logits_bytes'] / 2**20:.0f} MiB)")
    lines += ["", "d. resident memory a session adds, per table byte (fresh process each; first run: 64 tokens)",
              f"{'V x D':>14} {'head':>7} {'file':>9} {'arena':>6} {'at start':>9} {'after run':>10} {'target':>7}"]
    for r in results["memory"]:
        verdict = "met" if r["after_first_run"] <= r["target"] else "NOT met"
        verdict = f"({'within' if verdict == 'met' else 'over'}; shown for the arena's price)" if r["arena"] else verdict
        lines.append(f"{r['vocab']:>7} x {r['width']:<4} {'tied' if r['tied'] else 'untied':>7} "
                     f"{'external' if r['external'] else 'inline':>9} {'on' if r['arena'] else 'off':>6} "
                     f"{r['at_start']:>8.2f}x {r['after_first_run']:>9.2f}x {'<= %.2fx' % r['target']:>9} {verdict}")
    if results.get("format_memory"):
        lines += ["", "d'. the tied head at every format: resident bytes after a 64-token run per embed.table_bytes "
                  "(codes + scales; fresh process each, external data), and a later 64-token run's time",
                  f"{'V x D':>14} {'format':>10} {'table_bytes':>12} {'at start':>9} {'after run':>10} {'run ms':>8}"]
        for r in results["format_memory"]:
            lines.append(f"{r['vocab']:>7} x {r['width']:<4} {r['format']:>10} {r['table_bytes']:>12} "
                         f"{r['at_start']:>8.2f}x {r['after_first_run']:>9.2f}x {r['run_s'] * 1e3:>8.1f}")
    lines += ["", "e. per-run floor (Identity on one float): run %.1f us, run_with_iobinding %.1f us"
              % (floor["run_s"] * 1e6, floor["iobinding_s"] * 1e6), "", "targets:"]
    lines += [f"  {'met    ' if ok else 'NOT met'}  {what}" for what, ok in targets(results)]
    return "\n".join(lines)


def _why(r):
    """Where a head run that is slower than numpy loses, in this run's figures."""
    table = 4 * r["vocab"] * r["width"]
    if r["tokens"] == 1:
        return (f"one pass over the table at {table / r['run_s'] / 1e9:.1f} GB/s in MLAS's M = 1 path (by MLAS's "
                f"source SgemmKernelM1TransposeB, AVX; not read from this run) against "
                f"{table / r['numpy_s'] / 1e9:.1f} GB/s in OpenBLAS's {r['kernel']} sgemv (the kernel numpy loaded)")
    flops = 2 * r["tokens"] * r["vocab"] * r["width"]
    packing = max(0.0, r["run_s"] - r["packed_copy_s"])
    return (f"MLAS's SGEMM at {flops / r['run_s'] / 1e9:.0f} GFLOP/s against OpenBLAS's {flops / r['numpy_s'] / 1e9:.0f}; "
            f"packing the table on every call takes {packing * 1e3:.0f} ms a run (a head reading a packed second "
            f"table skips it: {r['packed_copy_s'] / r['numpy_s']:.2f}x numpy, at the price of that table)")


def targets(results):
    """[(target, met)] from the figures of this run."""
    memory, head = results["memory"], results["head"]
    found = [
        ("tied <= 1.10x table bytes after the first run, every size and file layout (Runner settings)",
         all(r["after_first_run"] <= 1.10 for r in memory if r["tied"] and not r["arena"])),
        ("untied <= 2.10x table bytes after the first run", all(r["after_first_run"] <= 2.10 for r in memory
                                                                 if not r["tied"])),
        ("Gather no slower than numpy take(out=) at n >= 256",
         all(r["gather_vs_take"] <= 1 for r in results["lookups"] if r["tokens"] >= 256)),
        ("Runner.run(feeds) <= 1.0x numpy's best matmul, every size and N (%s)" %
         ", ".join(f"{r['vocab']}x{r['width']} N={r['tokens']}: {r['run_vs_numpy']:.2f}x" for r in head),
         all(r["run_vs_numpy"] <= 1 for r in head)),
        ("Runner.run(feeds, out=) <= 1.0x numpy's best matmul (%s)" %
         ", ".join(f"N={r['tokens']}: {r['run_out_vs_numpy']:.2f}x" for r in head),
         all(r["run_out_vs_numpy"] <= 1 for r in head)),
        ("tied head resident after its runs <= 1.10x table + logits returned (%s)" %
         ", ".join(f"{r['vocab']}x{r['width']}: {r['memory']['ratio']:.2f}x" for r in head if "memory" in r),
         all(r["memory"]["ratio"] <= 1.10 for r in head if "memory" in r)),
    ]
    if results.get("format_lookups"):
        found.append(("a lookup costs its rows, not the table: V large / V small <= 1.5x at every format (%s)" %
                      ", ".join(f"{r['format']}: {r['large_vs_small']:.2f}x" for r in results["format_lookups"]),
                      all(r["large_vs_small"] <= 1.5 for r in results["format_lookups"])))
    if results.get("format_memory"):
        found.append(("tied head <= 1.10x table_bytes after a run at every format (%s)" %
                      ", ".join(f"{r['format']} {r['vocab']}: {r['after_first_run']:.2f}x"
                                for r in results["format_memory"]),
                      all(r["after_first_run"] <= 1.10 for r in results["format_memory"])))
    return found


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
    for (vocab, width) in dict.fromkeys((r["vocab"], r["width"]) for r in results["head"]):
        rows = [r for r in results["head"] if (r["vocab"], r["width"]) == (vocab, width)]
        right.semilogx([r["tokens"] for r in rows], [r["run_vs_numpy"] for r in rows], "o-",
                       label=f"Runner.run / numpy, {vocab} x {width}")
        right.semilogx([r["tokens"] for r in rows], [r["run_out_vs_numpy"] for r in rows], "^--",
                       label=f"run(out=) / numpy, {vocab} x {width}")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("tokens N")
    right.set_ylabel("time ratio to numpy, same run")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
