"""The first lines of inspect's report (its verdict, findings.verdict's entries, in words and units a person reads),
the lines --check ends with, and the rules every line of the report keeps: sizes in KiB/MiB/GiB, at most WIDTH
characters (longer ones wrapped, their continuation indented)."""
import re
import textwrap

from runtime.model.findings.counting import human, times
from runtime.model.read.text import printable
from runtime.inspect.verdict import FAILING

WIDTH = 100  # the most characters a line of the report takes

_SIZE = re.compile(r"\d (bytes?|KiB|MiB|GiB)\b")
_KEEP = "\ue000"  # private use: printable() escapes any a name brings; textwrap sees no space in it

FOOTER = "terms (held, prepacked, run-time view, resident, Pss): docs/inspect.md, Glossary"

_TIES = {
    "wrong_tie": "WRONG TIE {t}: config.json says tie_word_embeddings false, but the head scores with this table",
    "lost_tie": "LOST TIE {t}: config.json says tie_word_embeddings true, but the head of its shape holds other values",
}


def wrap(text):
    """`text` (one or more lines) with every line over WIDTH characters wrapped at spaces, each continuation indented
    four more than the line it continues."""
    lines = []
    for line in text.split("\n"):
        if len(line) <= WIDTH:
            lines.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip(" "))]
        kept = _SIZE.sub(lambda m: m.group(0).replace(" ", _KEEP), line)  # a figure and its unit on one line
        lines += [part.replace(_KEEP, " ") for part in
                  textwrap.wrap(kept, WIDTH, subsequent_indent=indent + "    ", break_on_hyphens=False)]
    return "\n".join(lines)


def line(text):
    """One line of the report: made printable (names in a model are untrusted text: none can forge a line or move
    the cursor), then wrapped."""
    return wrap(printable(text))


def lines(verdict, vocabulary, where, process, static, folder_files=1):
    """The verdict's lines: one (and its fix or why not) per failing entry, or one line saying all is well; then
    each head that scores every prompt position (informational). `vocabulary`
    {table: its vocabulary entry} (sizes and format); `where` {table: the files that store it} for a folder (else
    empty); `process` what holds the sessions ("a session", "the client's process"); `folder_files` how many
    files a folder has (a table's file is named where there are several)."""
    found = []
    for e in [e for e in verdict if e["kind"] in FAILING]:
        v = vocabulary.get(e["table"], {})
        size = f"{v['vocab_size']} x {v['width']} {v['format']}, {human(v['bytes'])}" if v else ""
        files = where.get(e["table"])
        place = f" in {', '.join(files)}" if files else ""
        if e["kind"] in _TIES:
            found.append(_TIES[e["kind"]].format(t=e["table"]) + (f" ({size})" if size else ""))
        else:
            held = "" if e["copies_in_memory"] is None else f", held {times(e['copies_in_memory'])} by {process}"
            wasted = [f"{human(e['wasted_bytes_on_disk'])} on disk"] if e["wasted_bytes_on_disk"] else []
            wasted += [f"{human(e['wasted_bytes_in_memory'])} in memory{_not_resident(e, v)}"] \
                if e["wasted_bytes_in_memory"] else []
            found.append(f"{e['table']}{f' ({size})' if size else ''}: stored {times(e['copies_on_disk'])}{place}"
                         f"{held}; wasted: {', '.join(wasted)}")
        found.append(f"  fix: {e['fix']} (writes a copy that holds it once)" if e["fix"] else
                     f"  no --retie fix: {e['why_not']}")
    return (found or _all_well(vocabulary, process, static)) + quantized(verdict, vocabulary, folder_files > 1) + \
        scored(verdict, bool(where))


def quantized(verdict, vocabulary, folder):
    """The lines of the verdict's quantized_copy entries: the float table its head holds again as codes (its file
    named where several are `folder`'s; its size is the fix's saving and the vocabulary's line), and what
    --lookup-from-head would save and change (or why it cannot)."""
    said = []
    for e in (e for e in verdict if e["kind"] == "quantized_copy"):
        v = vocabulary.get(e["table"], {})
        where = f" ({e['file']})" if folder else ""
        said.append(f"{e['table']}{where}: " + (f"held again as head {e['head']}'s {e['bits']}-bit codes"
                                                      if e["quantized"] == "head" else
                                                      f"looked up as {e['bits']}-bit codes of head {e['head']}'s values"))
        if not e["fix"]:
            said.append(f"  no --retie fix: {e['why_not']}")
            continue
        memory = _memory_saved(e, v)
        said.append(f"  fix: {e['fix']} (opt-in: saves {human(e['wasted_bytes_on_disk'])} on disk{memory}; "
                    f"looked-up values move within {e['max_error_in_scales']:.2f} of a quantization step)")
        other = e.get("shared_int8")
        if other:
            said.append(f"  or:  {other['fix']} (opt-in: one int8 table made anew for both, saves "
                        f"{human(other['saved_bytes_on_disk'])} on disk; the head's values move too, each within "
                        "half an int8 step of the float table's)")
        said.append("  either retie measures its price on a text: KL divergence, same top token, perplexity")
    return said


def _memory_saved(e, vocabulary):
    """' and N in memory' for a quantized_copy entry `e`, or, where a run measured less than half the table resident
    beyond the other weights (a table onnxruntime maps from its data file keeps only the rows looked up), that the
    copy is held but was not resident: then the saving is on disk, not in resident memory."""
    if e["wasted_bytes_in_memory"] is None:
        return ""
    resident = ((vocabulary.get("in_memory") or {}).get("defaults") or {}).get("times_table")
    if resident is not None and resident < 0.5:
        return f"; in memory little: mapped from its data file, a run left {resident:.2f}x the table resident"
    return f" and {human(e['wasted_bytes_in_memory'])} in memory"


def _not_resident(e, vocabulary):
    """What a run measured, where it shows fewer copies of the table resident than entry `e` counts held (their
    `vocabulary` entry's times_table more than half a copy below them): a copy onnxruntime maps from the data file
    and only a lookup reads keeps just the rows it looked up resident, so holding it wastes no resident memory;
    else nothing."""
    measured = (vocabulary.get("in_memory") or {}).get("defaults") or {}
    resident, held = measured.get("times_table"), e["copies_in_memory"]
    if resident is None or held is None or resident > held - 0.5:
        return ""
    return f" held, yet resident after a run only {resident:.2f}x the table beyond the other weights"


def scored(verdict, folder, named=True):
    """The lines of the verdict's informational entries, each head that scores every prompt position (its file
    named in a `folder`'s report; called "the head" where not `named`), as lines() ends with them."""
    return [line for e in verdict if e["kind"] == "all_positions_scored" for line in _scored(e, folder, named)]


def _scored(e, folder, named):
    """The lines of an all_positions_scored entry: the bytes of logits a prefill makes, and its fix or why none."""
    where = f" ({e['file']})" if folder else ""
    read = human(e["logits_bytes"] - e["wasted_bytes_in_memory"])
    head = f"{e['table']}{where}: scores" if named else "the head scores"
    return [f"{head} all {e['prompt_tokens']} prompt positions, {human(e['logits_bytes'])} of logits"] + _share(e) + [
            f"  fix: {e['fix']} (writes a copy that scores the last position only: {read})" if e["fix"] else
            f"  no --retie fix: {e['why_not']} (a generating client reads {read} of them)"]


def _share(e):
    """['  the head: 1.2 s of a 3.4 s prefill (35%), measured: ...'] from a sandbox.timing run (--time-prefill), else
    ['  the head: 5.8 G of 29.1 G multiply-adds of a prefill (20%), counted ...'] from the graph, and why no run was
    made where one was asked for."""
    timing, counted = e.get("timing"), e.get("counted")
    if timing and "why" not in timing:
        run, head = timing["run_seconds"], timing["head_seconds"]
        share = f" ({100 * head / run:.0f}%)" if run > 0 else ""
        return [f"  the head: {_seconds(head)} of a {_seconds(run)} prefill{share}, measured: one run under "
                "onnxruntime's defaults"]
    lines = []
    if counted:
        head, total = counted["head_multiply_adds"], counted["multiply_adds"]
        share = f" ({100 * head / total:.0f}%)" if total > 0 else ""
        lines.append(f"  the head: {_count(head)} of {_count(total)} multiply-adds of a prefill{share}, counted "
                     "(--time-prefill runs it)")  # what was counted: --json's `what`, the docs
    return lines + ([f"  {timing['why']}"] if timing else [])


def _count(value):
    """'5.8 G', '120.0 M', '3.1 k', '512': a count of multiply-adds as a person reads it."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value}"


def _seconds(value):
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _all_well(vocabulary, process, static):
    """The one line that says no table is held twice."""
    tables = [v for v in vocabulary.values()]
    count = f"{len(tables)} table{'s' if len(tables) != 1 else ''}"
    if not tables:
        return ["no table: nothing reads rows from an initializer, so nothing here is held twice"]
    if static:
        return [f"all well on disk: {count}, each stored once (--static: what a session holds is not counted)"]
    return [f"all well: {count}, each stored once and held once by {process}"]


def _reason(e, wasted=True):
    """Why entry `e` fails --check, in a few words (and the bytes it wastes); a variant's named by its dtype."""
    table = f"{e['dtype']}: {e['table']}" if e.get("dtype") else e["table"]
    if e["kind"] in _TIES:
        return f"{table} {e['kind'].replace('_', ' ')}"
    if e["kind"] == "stored_more_than_once":
        return (f"{table} stored {times(e['copies_on_disk'])}" +
                (f" ({human(e['wasted_bytes_on_disk'])} wasted on disk)" if wasted else ""))
    return (f"{table} held {times(e['copies_in_memory'])}" +
            (f" ({human(e['wasted_bytes_in_memory'])} wasted in memory)" if wasted else ""))


def check_lines(verdict):
    """The lines --check ends the report with: each failing entry, then a last line that says why it failed (each
    reason, as many as fit WIDTH, the rest counted) or that it passed."""
    failing = [e for e in verdict if e["kind"] in FAILING]
    if not failing:
        return ["--check: passed: no table stored or held more than once, no tie config.json contradicts"]
    reasons = [_reason(e, wasted=False) for e in failing]
    last = f"--check: failed ({len(reasons)}): "
    for i, reason in enumerate(reasons):
        more = f"and {len(reasons) - i} more (above)"
        if i and len(last) + len(reason) + len("; ") + len(more) + 2 > WIDTH:
            last += f"; {more}"
            break
        last += ("; " if i else "") + reason
    return [f"--check: FAIL {_reason(e)}" for e in failing] + [last]
