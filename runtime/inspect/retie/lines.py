"""Every line --retie says of what it did, for a file and a folder alike: what was rewritten and proven, what
--logits-to-keep added, a proof's failure, what was written and saved on disk, and each table's copies before ->
after."""
import os

from runtime.bounds import NARROW, bound_words
from runtime.model.findings import counting
from runtime.model.findings.counting import human, times
from runtime.feeds import USE_CACHE_BRANCH, describe

NOTHING = "retie: nothing to do: no table is held twice in a form --retie rewrites (any left is named above)\n"


def failure_line(failure, where=""):
    """The line that says why nothing was written: a proof's first failure (`where`: the file's name and ': ')."""
    said = failure if failure.startswith("failed") else f"not proven, nothing written: {failure}"
    return f"retie: {where}{said}\n"


def disk_change(before, after):
    """'saved N' or 'N bytes more' (alignment padding can outweigh a small table): never a negative saving."""
    return f"saved {human(before - after)}" if after <= before else f"{human(after - before)} more"


def on_disk(before, after):
    """'B -> A on disk (saved N)': the bytes on disk before and after."""
    return f"{human(before)} -> {human(after)} on disk ({disk_change(before, after)})"


def wrote_line(out, before, after, what=""):
    """The line that says OUT was written: `what` it holds, if said, and its bytes on disk before -> after."""
    return f"retie: wrote {out}{': ' + what if what else ''}: {on_disk(before, after)}\n"


AS_RETIED = "as the original (the retied logits within their bound)"  # k = 0, a head retied in the same run


def kept_line(keep, default, shape, where="", retied=False):
    """The line that says what --logits-to-keep added and what its proof found; `retied`: a head was retied in the
    same run (its logits then within their bound at k = 0 too)."""
    exact = (keep.get("kept") or {}).get("exact")
    nbits = any(h.nbits for h in keep["heads"].values())
    narrow = [f for f in (keep.get("kept") or {}).get("formats", []) if f in NARROW]
    last = ("bit for bit (the kernel computes each row alike)" if exact else
            "within MatMulNBits' bound at its accuracy level" if nbits else
            f"within {' and '.join(map(bound_words, narrow or ['float32']))}")
    return (f"retie: {where}{', '.join(keep['outputs'])}: input {keep['input']} (int64 scalar, default {default}) "
            f"keeps the last k positions before the head (0: all); proven on decoder feeds ({describe(shape)}): "
            f"with 0 every output {AS_RETIED if retied else 'bit for bit'}, with 1 the last position's logits {last} "
            "and every other output bit for bit\n")


def rewritten_line(rewritten, model, shape, where="", fed=(), weights=None, replaced=False):
    """The line that says what a proven retie of `model` rewrote and on which feeds (feeds.plan's `shape`; `fed`:
    the inputs another file made, retie_folder.upstream; `weights`: branches.in_place's, the shared weights read in
    place; `replaced`: --lookup-from-head changed looked-up rows, the original then run on the head's rows; the
    string "int8": --shared-int8 made the head's codes anew, the original run on them and on their rows);
    `where`: the file's name and ': ', in a folder."""
    kept = ", ".join(sorted({r.now for r in rewritten}))
    heads = sum(r.hidden is not None for r in rewritten)
    lookups = len(rewritten) - heads
    changed = [f"{heads} head{'s' if heads != 1 else ''} now a Gemm on its run-time view"] if heads else []
    changed += [f"{lookups} lookup{'s' if lookups != 1 else ''} now reading the head's codes"] if lookups else []
    if weights:
        size = sum(weights.sizes.values())
        size = f"{size / 2**20:.1f} MiB" if size >= 2**20 // 10 else f"{size} bytes"
        changed.append(f"the {len(weights.sizes)} weight{'s' if len(weights.sizes) != 1 else ''} its branches share "
                       f"({size}, each prepacked once per branch before) read in place")
    merged = any(v.name == USE_CACHE_BRANCH for v in model.proto.graph.input)
    feeds = describe(shape) + (", both branches of use_cache_branch" if merged else "") + "".join(
        f", {f.input} from {os.path.basename(f.checked['path'])}" for f in fed)
    return (f"retie: {where}{kept} is now the one copy ({'; '.join(changed)}); proven on decoder feeds ({feeds}): "
            f"{_heads_said(getattr(weights, 'heads', None))}, every other output {_others(weights)}"
            f"{(INT8_SAME if replaced == 'int8' else LOOKED_UP_SAME) if replaced else ''}\n")


LOOKED_UP_SAME = " against the original looking up the head's rows"  # --lookup-from-head's proof
INT8_SAME = " against the original with its head's int8 codes and their rows"  # --shared-int8's


def lookup_lines(looked_up, found, measured=None, where=""):
    """[line]: the lines that say what --lookup-from-head did (write.Plan's `looked_up`, its proof's record): each float
    table gone, its rows now the head's (checked for every id) and how far they moved, and the resident growth of a
    run before -> after where `measured` ({"defaults": figures}) says it. What that costs the model's choices leads
    (retie.quality.lines); the greedy runs' agreement is --json's (token_agreement)."""
    said, heads = [], {p.head: p.head_entry for p in found.pairs}  # as the original holds them
    vocabulary = {v["table"]: v for v in found.vocabulary}
    for lookup in looked_up["lookups"]:
        if lookup.requantized:
            said.append(int8_line(lookup, heads, found.model, where))
        v, change = vocabulary[lookup.table], looked_up["changes"][lookup.table]
        before = v["in_memory"]["defaults"].get("resident_bytes")
        after = ((measured or {}).get("defaults") or {}).get("resident_bytes")
        grew = (f"; one run adds {human(after)} resident, was {human(before)}"
                if None not in (before, after) and v["bytes"] >= counting.RESOLUTION else "")
        said.append(f"retie: {where}{lookup.table} ({v['format']}, {human(v['bytes'])}) is gone: the lookup reads "
                    f"{lookup.codes}, each of its {v['vocab_size']} rows the head's dequantization bit for bit (every "
                    f"id checked); a row's element moved by up to {change['max_row_change']:.3g} "
                    f"({change['max_row_change_in_steps']:.2f} of its quantization step){grew}\n")
    return said


def int8_line(lookup, heads, model, where=""):
    """What --shared-int8 made of a head: its codes anew from the float table, their layout, and what went."""
    old = next(h for h in heads.values() if h.node is lookup.head.node)
    q, tensors = lookup.head.quant, model.tensors
    made = tensors[q.codes].nbytes + tensors[q.scale].nbytes
    gone = sum(tensors[n].nbytes for n in (old.quant.codes, old.quant.scale, old.quant.zero_point) if n in tensors)
    return (f"retie: {where}head {old.initializer} ({old.quant.bits}-bit, {human(gone)}) now multiplies "
            f"{q.codes}: int8 codes made anew from {lookup.table}, blocks of {q_attribute(lookup.head, 'block_size')}, "
            f"{tensors[q.scale].type_name} scales, symmetric (no zero points stored: MatMulNBits' 128), "
            f"{human(made)}, accuracy_level {q_attribute(lookup.head, 'accuracy_level')} (int8 products: "
            "onnxruntime's float kernel for 8-bit codes is ten times slower); the lookup reads the same codes\n")


def q_attribute(head, name):
    """An integer attribute a MatMulNBits head's node declares (block_size, accuracy_level), 0 where absent."""
    return next((a.i for a in head.node.attribute if a.name == name), 0)


def _heads_said(found):
    """What the proof found of the heads' outputs (agree.heads_found's, or None), in words: within float32's bound,
    or within the bound of the narrower format they were compared in, and whether they were bit for bit there."""
    narrow = [f for f in (found or {}).get("formats", []) if f in NARROW]
    if not narrow:
        return "the logits within float32's rounding bound"
    seen = " (on these feeds bit for bit)" if found["exact"] else ""
    return f"the logits within {' and '.join(map(bound_words, narrow))}{seen}"


def _others(weights):
    """What the proof found of the outputs other than the heads: bit for bit, and where a merged decoder's weights
    are read in place, against which run of the export, and how far they lie from its run under the defaults."""
    if not weights:
        return "bit for bit"
    drift = weights.drift
    if drift is None:
        return f"bit for bit with the export's run under {counting.NO_PREPACKING}"
    if not drift["most"]:
        return f"bit for bit with the export's run under the defaults and under {counting.NO_PREPACKING}"
    # not a bound on every feed: the export's own two runs differ so, their products each within float32's bound
    return (f"bit for bit with the export's run under {counting.NO_PREPACKING}; under the defaults the export's "
            "kernels read their own packed copies and sum a row's products in another order, each product within "
            f"float32's rounding bound of the other's: its outputs lay within {drift['most']:.2g} of these on these "
            f"feeds ({drift['output']}, {drift['at']}; values up to {drift['largest']:.2g})")


def widened_note(fmt):
    """What a float16 / bfloat16 table's second copy after a retie is, to end an outcome line with."""
    return (f"; one is onnxruntime's CPU provider's float32 widening of the {fmt} head's weight, which no rewrite "
            f"that keeps the table {fmt} removes")


def outcome_line(table, stored, held, size, by, fmt=None, notes=("", "")):
    """The outcome of a retie for `table` in one line: its copies on disk (`stored`: before, after) and in memory
    (`held`: before, or None where not known, and after) `by` a session or the client's process under
    onnxruntime's defaults, and the bytes that saves (`size` a copy); `notes`: what is said after the memory
    saved, and after all that (how it was counted or measured); where a float16 / bfloat16 table (`fmt`) is still
    held twice, that the second copy is the CPU provider's float32 widening."""
    (disk_was, disk), (was, now) = stored, held
    line = (f"retie: {table}: stored {times(disk_was)} -> {times(disk)}" if disk_was != disk else
            f"retie: {table}: stored {times(disk)}")
    line += f", held {'?' if was is None else times(was)} -> {times(now)} by {by} under onnxruntime's defaults"
    saved = [f"{human((disk_was - disk) * size)} on disk"] if disk_was > disk else []
    saved += [f"{human((was - now) * size)} in memory{notes[0]}"] if was is not None and was > now else []
    line += (f"; saved {', '.join(saved)}" if saved else "") + notes[1]
    return line + (widened_note(fmt) if now > 1 and fmt in NARROW else "")


def not_resident(saved, before, after, how=""):
    """What follows "saved <saved bytes> in memory" where the resident growth a run measured before and after the
    retie (`before`, `after`; None: not measured) does not show half of it: the copy no longer held (`how` it was
    found, as " (counted)") was not resident (a copy onnxruntime maps from the data file that only a lookup reads
    keeps just the rows it looked up); else `how`, as for a saving under counting.RESOLUTION, which resident bytes
    do not show."""
    if None in (before, after) or saved < counting.RESOLUTION or before - after >= saved / 2:
        return how
    return f" held{how}, though it was not resident"


def gained_line(table, copies, was, figures, stored):
    """outcome_line for a single file's `table`: `stored` its copies on disk before (once after), `copies` held
    after (the vocabulary entry `was` before) by a session; what a run adds (memory.measure's `figures`) only where
    the table is large enough for resident bytes to show it (counting.RESOLUTION), else that it is too small to;
    why, where the copies stay as they were."""
    counted = None if was is None else was["tables_in_memory"]
    size = 0 if was is None else was["bytes"]
    before = None if was is None else was["in_memory"]["defaults"].get("resident_bytes")
    after = None if figures is None else figures.get("resident_bytes")
    measured = ""
    if size >= counting.RESOLUTION and None not in (before, after):
        measured = f" (one run adds {human(after)} resident, was {human(before)})"
    elif size:
        measured = f" (counted: {human(size)} is too small a table for resident bytes to show it)"
    fmt = None if was is None else was.get("format")
    saved = size * (counted - copies) if counted is not None else 0
    line = outcome_line(table, (stored, 1), (counted, copies), size, "a session", fmt,
                        (not_resident(saved, before, after), measured))
    if copies == counted and copies > 1 and fmt not in NARROW:
        line += "; the head's kernel prepacks its own copy of the codes, with or without the retie"
    return line + "\n"
