"""The bench's report: one section per measurement, then the targets, each met or not with its figures."""
import os

import numpy as np
import onnxruntime as ort

from runtime.bench.scale import lines as scale_lines
from runtime.bench.scale import targets as scale_targets


def report(results):
    """The bench's text report: a section per measurement, then each target met or not."""
    lines = [f"machine: {os.cpu_count()} cores; onnxruntime {ort.__version__}, numpy {np.__version__}", ""]
    lines += _lookup_lines(results)
    floor = results["floor"]
    lines += _head_lines(results["head"], floor)
    lines += _memory_lines(results["memory"])
    if results.get("formats"):
        lines += _format_lines(results["formats"])
    lines += ["", "e. per-run floor (Identity on one float): run %.1f us, run_with_iobinding %.1f us"
              % (floor["run_s"] * 1e6, floor["iobinding_s"] * 1e6)]
    if results.get("scale"):
        lines += ["", "f. inspect at the sizes people ship: each command's wall time and peak summed Pss of its process "
                  "tree, as ratios to a plain session (load + one run) of the same generated model"]
        lines += [line for figures in results["scale"] for line in scale_lines(figures)]
    lines += ["", "targets:"]
    lines += [f"  {'met    ' if ok else 'NOT met'}  {what}" for what, ok in targets(results)]
    return "\n".join(lines)


def _lookup_lines(results):
    """a/b, b', b'': the lookups against numpy's take(out=), at every format, and int4's two ways."""
    lines = ["a/b. lookups, width 768 (Gather and OneHot+MatMul through io_binding into a preallocated output)",
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
                  f"{'format':>10} " + " ".join(f"{'V=' + v + ' us':>13}" for v in vocabs) + f" {'large/small':>12}"
                  "  (median of 7 same-round ratios; lowest-highest)"]
        for r in results["format_lookups"]:
            lines.append(f"{r['format']:>10} " + " ".join(f"{r['seconds'][v] * 1e6:>13.1f}" for v in vocabs)
                         + f" {r['large_vs_small']:>12.2f}" + (f"  ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})"
                                                                 if r.get("spread") else ""))
    if results.get("packed_rows"):
        first = results["packed_rows"][0]
        lines += ["", f"b''. the int4 lookup two ways, V={first['vocab']} x 768, blocks of {first['block_size']}: "
                  "GatherBlockQuantized (the lab's) against Gather of the packed rows unpacked in the graph"]
        for r in results["packed_rows"]:
            kept = "GatherBlockQuantized" if r["gbq_s"] <= r["packed_rows_s"] else "packed rows"
            lines.append(f"{r['tokens']:>6} ids: {r['gbq_s'] * 1e6:>7.0f} us against {r['packed_rows_s'] * 1e6:>7.0f} us "
                         f"({r['packed_rows_vs_gbq']:.2f}x), same bits: {r['same_bits']}; faster: {kept}")
    return lines


def _head_lines(rows, floor):
    """c: the tied head through Runner.run against numpy, a row per size and N, and why where it is slower."""
    lines = ["", "c. the tied head through Runner.run (the default path, and with out= buffers) against numpy's best "
             "2-D matmul on the same table, numpy in a child process with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE "
             "unset and, where they are unset here too, raced in the same rounds (run/numpy and out=/numpy: the median "
             "of the same-round ratios, their spread in the targets); the last two columns (ms) show where the time goes, each at a price in memory: the head reading a "
             "second, prepacked copy of the table (the untied graph on the same values), and the tied model with the "
             f"arena on; per-run floor: run {floor['run_s'] * 1e6:.0f} us, io_binding {floor['iobinding_s'] * 1e6:.0f} us",
             f"{'V x D':>14} {'N':>5} {'numpy ms':>9} {'kernel':>9} {'run ms':>8} {'run/numpy':>10} "
             f"{'out= ms':>8} {'out=/numpy':>11} {'GFLOP/s':>8} {'packed copy':>11} {'arena on':>9}"]
    for r in rows:
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
    return lines


def _memory_lines(rows):
    """d: resident memory a session adds, per table byte."""
    lines = ["", "d. resident memory a session adds, per table byte (fresh process each; first run: 64 tokens)",
             f"{'V x D':>14} {'head':>7} {'file':>9} {'arena':>6} {'at start':>9} {'after run':>10} {'target':>7}"]
    for r in rows:
        verdict = "met" if r["after_first_run"] <= r["target"] else "NOT met"
        verdict = f"({'within' if verdict == 'met' else 'over'}; shown for the arena's price)" if r["arena"] else verdict
        lines.append(f"{r['vocab']:>7} x {r['width']:<4} {'tied' if r['tied'] else 'untied':>7} "
                     f"{'external' if r['external'] else 'inline':>9} {'on' if r['arena'] else 'off':>6} "
                     f"{r['at_start']:>8.2f}x {r['after_first_run']:>9.2f}x {'<= %.2fx' % r['target']:>9} {verdict}")
    return lines


def _format_lines(rows):
    """d': the tied head at every format: bytes resident, time, accuracy."""
    rate = rows[0]["bandwidth"]
    lines = ["", "d'. the memory meeting: the tied head at every format (int8 / int4: blocks of 32, MatMulNBits at "
             "accuracy_level 4), resident after a one-token run under onnxruntime's defaults (fresh process each), "
             "time per token and per 64-token prompt raced in the same rounds, the byte floor = table_bytes / "
             f"{rate / 1e9:.1f} GB/s (a streaming read measured in this run), accuracy against numpy's float32 head",
             f"{'V x D':>14} {'format':>9} {'table MiB':>9} {'resident':>9} {'anon/file MiB':>14} {'ms/token':>9} "
             f"{'vs f32':>7} {'vs floor':>9} {'ms/64':>8} {'vs f32':>7} {'top-8':>6} {'logit err':>10}"]
    for r in rows:
        name = r["format"] + ("*" if r.get("variant") else "")
        lines.append(f"{r['vocab']:>7} x {r['width']:<4} {name:>9} {r['table_bytes'] / 2**20:>9.1f} "
                     f"{r['times_table']:>8.2f}x {r['anonymous_bytes'] / 2**20:>6.0f}/{r['file_bytes'] / 2**20:<7.0f} "
                     f"{r['token_s'] * 1e3:>9.2f} {r['token_vs_float32']:>6.2f}x {r['token_vs_floor']:>8.2f}x "
                     f"{r['prompt_s'] * 1e3:>8.1f} {r['prompt_vs_float32']:>6.2f}x {r['top8_overlap']:>6.1%} "
                     f"{r['logit_error']:>10.3g}")
    variants = dict.fromkeys((r["format"], r["variant"]) for r in rows if r.get("variant"))
    lines += [f"  * {fmt} with {variant}: no float32 copy made at load; the whole table is decoded on every run"
              for fmt, variant in variants]
    return lines


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


def _spread(spread):
    return f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else ""


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
        ("Runner.run(feeds) <= 1.0x numpy's best matmul, every size and N, median of same-round ratios (%s)" %
         ", ".join(f"{r['vocab']}x{r['width']} N={r['tokens']}: {r['run_vs_numpy']:.2f}x"
                   f"{_spread((r.get('spread') or {}).get('run'))}" for r in head),
         all(r["run_vs_numpy"] <= 1 for r in head)),
        ("Runner.run(feeds, out=) <= 1.0x numpy's best matmul (%s)" %
         ", ".join(f"N={r['tokens']}: {r['run_out_vs_numpy']:.2f}x{_spread((r.get('spread') or {}).get('run_out'))}"
                   for r in head),
         all(r["run_out_vs_numpy"] <= 1 for r in head)),
        ("tied head resident after its runs <= 1.10x table + logits returned (%s)" %
         ", ".join(f"{r['vocab']}x{r['width']}: {r['memory']['ratio']:.2f}x" for r in head if "memory" in r),
         all(r["memory"]["ratio"] <= 1.10 for r in head if "memory" in r)),
    ]
    for figures in results.get("scale") or ():
        found += scale_targets(figures)
    if results.get("format_lookups"):
        found.append(("a lookup costs its rows, not the table: V large / V small <= 1.5x at every format, median of "
                      "7 same-round ratios (%s)" % ", ".join(f"{r['format']}: {r['large_vs_small']:.2f}x"
                                                            f"{_spread(r.get('spread'))}"
                                                            for r in results["format_lookups"]),
                      all(r["large_vs_small"] <= 1.5 for r in results["format_lookups"])))
    if results.get("formats"):
        by = {(r["vocab"], r["width"], r["format"]): r for r in results["formats"] if not r.get("variant")}
        sizes = [(v, w) for v, w, f in by if f == "float32"]
        judged = [s for s in sizes if s in ((50257, 768), (128256, 4096))]
        for fmt, limit in (("int4", 0.20), ("int8", 0.35)):
            found.append((f"{fmt} head <= {limit:.2f}x the float32 head's time at N = 1, median of 5 same-round "
                          "ratios (%s)" % ", ".join(f"{v}x{w}: {by[v, w, fmt]['token_vs_float32']:.2f}x"
                                                   f"{_spread(by[v, w, fmt].get('token_spread'))}" for v, w in judged),
                all(by[v, w, fmt]["token_vs_float32"] <= limit for v, w in judged)))
        found.append(("int4 head within 3x its byte floor at N = 1 (%s)" % ", ".join(
            f"{v}x{w}: {by[v, w, 'int4']['token_vs_floor']:.2f}x" for v, w in sizes),
            all(by[v, w, "int4"]["token_vs_floor"] <= 3 for v, w in sizes)))
        found.append(("tied int8 / int4 resident after a run <= 2.3x table_bytes under onnxruntime's defaults (%s)" %
                      ", ".join(f"{f} {v}x{w}: {by[v, w, f]['times_table']:.2f}x" for v, w in sizes
                                for f in ("int8", "int4")),
                      all(by[v, w, f]["times_table"] <= 2.3 for v, w in sizes for f in ("int8", "int4"))))
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


def plot_formats(rows, path):
    """The memory meeting as a picture: resident bytes after a run against ms per token, one point per format and
    size (matplotlib, optional)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5))
    markers = dict(zip(("float32", "float16", "bfloat16", "int8", "int4"), "os^Dv"))
    colors = {}
    for (vocab, width) in dict.fromkeys((r["vocab"], r["width"]) for r in rows):
        here = [r for r in rows if (r["vocab"], r["width"]) == (vocab, width)]
        ax.plot([r["token_s"] * 1e3 for r in here], [r["resident_bytes"] / 2**20 for r in here], ":", color="grey")
        for r in here:
            name = r["format"] + (f", {r['variant']}" if r.get("variant") else "")
            ax.plot(r["token_s"] * 1e3, r["resident_bytes"] / 2**20, markers.get(name, "x"), markersize=8,
                    color=colors.setdefault(name, f"C{len(colors)}"),  # one colour per format, every size
                    label=name if (vocab, width) == (rows[0]["vocab"], rows[0]["width"]) else None)
            ax.annotate(f"{vocab}x{width}", (r["token_s"] * 1e3, r["resident_bytes"] / 2**20), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ms per token (N = 1), same run")
    ax.set_ylabel("resident MiB after a run (onnxruntime's defaults)")
    ax.set_title("The tied head at every format: bytes held against time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
