"""--markdown FILE: the run's figures as Markdown tables, each followed by the date and machine of the run.

A file that exists is rewritten only inside its marked regions, `<!-- bench:NAME -->` ... `<!-- /bench -->`
(BENCHMARKS.md holds one per table, with the prose around them its own); a new file gets every table, each under
a heading and in its region, to start such a page from.
"""
import os

from runtime.bench.page import REGION, stamp, table
from runtime.bench.scale import markdown_table as scale
from runtime.bench.summary import targets as judged


def _size(r):
    return f"{r['vocab']} × {r['width']}"


def _spread(spread):
    return f" ({spread[0]:.2f}–{spread[1]:.2f})" if spread else ""


def machine(results):
    """The run itself: when, where, what ran, how long."""
    rows = [["date (UTC)", results.get("date", "?")], ["CPU", results.get("cpu", "?")],
            ["cores", results.get("cores", "?")], ["memory", f"{results.get('memory_bytes', 0) / 2**30:.0f} GiB"],
            ["onnxruntime", results.get("onnxruntime", "?")], ["numpy", results.get("numpy", "?")],
            ["command", f"`{results.get('command', 'python -m runtime.bench')}`"],
            ["duration", f"{results.get('seconds', 0) / 60:.1f} minutes"]]
    return table(["run", ""], rows, left=2)


def lookups(results):
    return table(["V", "ids", "np.take µs", "Gather µs", "Gather / take", "OneHot+MatMul ms", "OneHot / Gather",
                   "multiplications n·V·D"],
                  [[r["vocab"], r["tokens"], f"{r['take_s'] * 1e6:.1f}", f"{r['gather_s'] * 1e6:.1f}",
                    f"{r['gather_vs_take']:.2f}×", f"{r['onehot_s'] * 1e3:.2f}", f"{r['onehot_vs_gather']:.0f}×",
                    f"{r['onehot_multiplications']:.3g}"] for r in results["lookups"]])


def format_lookups(results):
    rows = results["format_lookups"]
    vocabs = list(rows[0]["seconds"])
    return table(["format"] + [f"V = {v} µs" for v in vocabs] + ["large / small (lowest–highest)"],
                  [[r["format"]] + [f"{r['seconds'][v] * 1e6:.1f}" for v in vocabs]
                   + [f"{r['large_vs_small']:.2f}×{_spread(r.get('spread'))}"] for r in rows])


def packed_rows(results):
    return table(["ids", "GatherBlockQuantized µs", "packed rows µs", "packed / GBQ", "same bits"],
                  [[r["tokens"], f"{r['gbq_s'] * 1e6:.0f}", f"{r['packed_rows_s'] * 1e6:.0f}",
                    f"{r['packed_rows_vs_gbq']:.2f}×", "yes" if r["same_bits"] else "NO"]
                   for r in results["packed_rows"]])


def head(results):
    rows = []
    for r in results["head"]:
        spread = r.get("spread") or {}
        rows.append([_size(r), r["tokens"], f"{r['numpy_s'] * 1e3:.2f}", r["kernel"], f"{r['run_s'] * 1e3:.2f}",
                     f"{r['run_vs_numpy']:.2f}×{_spread(spread.get('run'))}", f"{r['run_out_s'] * 1e3:.2f}",
                     f"{r['run_out_vs_numpy']:.2f}×{_spread(spread.get('run_out'))}", f"{r['flop_per_s'] / 1e9:.1f}",
                     f"{r['packed_copy_s'] * 1e3:.2f}", f"{r['arena_on_s'] * 1e3:.2f}"])
    return table(["V × D", "N", "numpy ms", "OpenBLAS kernel", "run ms", "run / numpy", "run(out=) ms",
                   "out= / numpy", "GFLOP/s", "packed copy ms", "arena on ms"], rows)


def head_memory(results):
    return table(["V × D", "after runs of N", "resident MiB", "table MiB", "logits returned MiB",
                   "resident / (table + logits)"],
                  [[_size(r), r["tokens"], f"{r['memory']['grown'] / 2**20:.0f}",
                    f"{r['memory']['table_bytes'] / 2**20:.0f}", f"{r['memory']['logits_bytes'] / 2**20:.0f}",
                    f"{r['memory']['ratio']:.2f}×"] for r in results["head"] if "memory" in r])


def memory(results):
    rows = []
    for r in results["memory"]:
        met = r["after_first_run"] <= r["target"]
        verdict = ("within" if met else "over") + " (the arena's price, not judged)" if r["arena"] else \
            ("met" if met else "NOT met")
        rows.append([_size(r), "tied" if r["tied"] else "untied", "external" if r["external"] else "inline",
                     "on" if r["arena"] else "off", f"{r['at_start']:.2f}×", f"{r['after_first_run']:.2f}×",
                     f"≤ {r['target']:.2f}×", verdict])
    return table(["V × D", "head", "table data", "arena", "at start", "after a run", "target", ""], rows, left=4)


def formats(results):
    rows = []
    for r in results["formats"]:
        name = r["format"] + (f", {r['variant']}" if r.get("variant") else "")
        rows.append([_size(r), name, f"{r['table_bytes'] / 2**20:.1f}", f"{r['times_table']:.2f}×",
                     f"{r['anonymous_bytes'] / 2**20:.0f} / {r['file_bytes'] / 2**20:.0f}", f"{r['token_s'] * 1e3:.2f}",
                     f"{r['token_vs_float32']:.2f}×", f"{r['token_vs_floor']:.2f}×", f"{r['prompt_s'] * 1e3:.1f}",
                     f"{r['prompt_vs_float32']:.2f}×", f"{r['top8_overlap']:.1%}", f"{r['logit_error']:.3g}"])
    return table(["V × D", "format", "table MiB", "resident / table", "anonymous / file MiB", "ms / token",
                   "vs float32", "vs byte floor", "ms / 64 tokens", "vs float32", "top-8 overlap",
                   "largest logit error"], rows, left=2)


def floor(results):
    f, rate = results["floor"], (results.get("formats") or [{}])[0].get("bandwidth")
    return table(["Identity on one float: run µs", "run_with_iobinding µs", "streaming read GB/s (the byte floor)"],
                  [[f"{f['run_s'] * 1e6:.1f}", f"{f['iobinding_s'] * 1e6:.1f}",
                    f"{rate / 1e9:.1f}" if rate else "not measured"]])


def targets(results):
    return table(["", "target (figures of this run)"],
                  [["met" if ok else "**NOT met**", what.replace("|", "/")] for what, ok in judged(results)], left=2)


TABLES = {"machine": machine, "lookups": lookups, "format_lookups": format_lookups, "packed_rows": packed_rows,
          "head": head, "head_memory": head_memory, "memory": memory, "formats": formats, "floor": floor,
          "scale": scale, "targets": targets}
OPTIONAL = {"scale"}  # measured only when asked (--scale): a run without it leaves its region as it was


def region(name, results):
    """The text of region `name`: its table, a blank line, the stamp."""
    return "\n".join(TABLES[name](results)) + "\n\n" + stamp(results) + "\n"


def regions_in(text):
    """The names of the marked regions in `text`, in order."""
    return [m.group(2) for m in REGION.finditer(text)]


def check_target(path):
    """ValueError (one line) unless --markdown can write `path`: a new file, or one whose marked regions all name
    a table this module writes (checked before the run)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        names = regions_in(f.read())
    if not names:
        raise ValueError(f"--markdown {path}: it exists and holds no <!-- bench:NAME --> ... <!-- /bench --> region "
                         "to rewrite; name a new file to get every table")
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        raise ValueError(f"--markdown {path}: no table named {unknown[0]!r} (tables: {', '.join(TABLES)})")


def render(results, text=None):
    """`text` with each marked region rewritten from `results`; None: a new page holding every table."""
    if text is None:
        return "# runtime.bench\n" + "".join(f"\n## {name}\n\n<!-- bench:{name} -->\n{region(name, results)}"
                                             "<!-- /bench -->\n" for name in TABLES
                                             if name not in OPTIONAL or results.get(name))
    return REGION.sub(lambda m: m.group(0) if m.group(2) in OPTIONAL and not results.get(m.group(2)) else
                      m.group(1) + region(m.group(2), results) + m.group(4), text)
