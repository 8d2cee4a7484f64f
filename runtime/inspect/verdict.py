"""The answer inspect opens with: one entry per table the files or a client's process hold more than once, or whose
tie config.json contradicts, with the bytes it wastes and the command that repairs it (or why none can)."""
from runtime.model.findings.counting import COPIES, stored_copies
from runtime.inspect.retie import int8share, keep
from runtime.model.findings.headcodes import FLAG
from runtime.inspect.retie.rules import WHY_NOT_PACKED, remedy

FAILING = ("held_more_than_once", "stored_more_than_once", "wrong_tie", "lost_tie")  # the kinds --check fails on
# and two it does not (informational): all_positions_scored (a decoder's head scores every prompt position) and
# quantized_copy (a float table a quantized head holds again as its codes: --lookup-from-head, opt-in)

RETIE = "--retie OUT"  # the fix, as a user types it

_WHY_NOT = {
    "wrong_tie": ("the graph scores with the input table; which of graph and config is right only the exporter "
                  "knows: correct config.json's tie_word_embeddings, or export again untied"),
    "lost_tie": ("the head holds other values than the table, so reading the table instead would change the "
                 "logits: export again from a model whose head is its table"),
}


def _entry(kind, vocabulary, file, counted, remedy):
    """One verdict entry for the table of `vocabulary` (its entry) in `file`: `counted` (copies on disk, in memory or
    None, bytes wasted on disk) and `remedy` (the fix, or None; why none, or None: a reason drops the fix)."""
    (on_disk, in_memory, wasted_on_disk), (fix, why_not) = counted, remedy
    wasted_in_memory = None if in_memory is None else max(in_memory - 1, 0) * vocabulary["bytes"]
    return {"kind": kind, "table": vocabulary["table"], "file": file, "copies_on_disk": on_disk,
            "copies_in_memory": in_memory,
            "wasted_bytes_on_disk": wasted_on_disk, "wasted_bytes_in_memory": wasted_in_memory,
            "fix": fix if why_not is None else None, "why_not": why_not}


_PACKED = ("packed_shared", "packed_duplicate")  # remedy()'s int4 forms: MatMulNBits packs the codes at load anyway



def why_not_widened(fmt):
    """Why no retie removes a copy onnxruntime's CPU provider makes of a `fmt` (float16, bfloat16) head's weight."""
    return (f"onnxruntime's CPU provider multiplies in float32: it widens the {fmt} head's weight at load, "
            f"whatever the file holds; no rewrite keeping the table {fmt} removes it")


def _widened(copies, table):
    """Whether onnxruntime's optimized model holds a float32 widening of `table` (runtime_copies' view)."""
    return any(c.get("copy_of") == table and str(c.get("view", "")).startswith("widened") for c in copies or [])


def _kind(on_disk, held):
    """`stored_more_than_once`, `held_more_than_once`, or None where a table is held once."""
    if on_disk > 1:
        return "stored_more_than_once"
    return "held_more_than_once" if held is not None and held > 1 else None


def _remedies(pairs, kind, widened=None):
    """(a fix, or None; why no retie can, or None) for a table's pairs that hold it twice: for a table stored once
    but held twice, not where an int4 head is what is held twice, nor where it is onnxruntime's float32 widening
    (`widened`: its format) of a half-precision head; else the fix where remedy() rewrites any of them, else the
    first reason remedy() gives."""
    found = [remedy(p) for p in pairs]
    hows = [how for how, _ in found if how]
    if kind == "held_more_than_once" and hows and all(how in _PACKED for how in hows):
        return None, WHY_NOT_PACKED
    if kind == "held_more_than_once" and widened:  # the second copy is the CPU provider's, not the file's: a retie
        return None, why_not_widened(widened)  # (remedy()'s view) keeps it, only no longer prepacked
    if hows:
        return RETIE, None
    why = next((why for _, why in found if why), None)
    return (None, why) if why else (RETIE, None)


def file_verdict(info, file=None):
    """The verdict of one file (examine.inspect_model's `info`): per table, `stored_more_than_once` where a head holds
    a (transposed) duplicate of it, else `held_more_than_once` where a session under onnxruntime's defaults holds it
    more than once (copies_in_memory null under --static). A stored copy that two branches read is one copy.
    Memory wasted is counted at the table's stored bytes per copy beyond the first."""
    found, by_table = [], {}
    for p in info.pairs:  # each table's pairs found once: a file of n tables and n heads has n^2 of them
        by_table.setdefault(p.table, []).append(p)
    for v in info.vocabulary:
        pairs = by_table.get(v["table"], [])
        mine = [p for p in pairs if p.relation in ("shared",) + COPIES]
        (on_disk, wasted), held = stored_copies(pairs, v["table"]), v["tables_in_memory"]
        kind = _kind(on_disk, held)
        if kind is None:
            continue
        widened = v["format"] if _widened(info.runtime_copies, v["table"]) else None
        fix, why = (_remedies(mine, kind, widened) if mine else
                    (None, "no head reads it: the copies are onnxruntime's own"))
        found.append(_entry(kind, v, file, (on_disk, held, wasted), (fix, why)))
    return found + quantized_copies(info, file) + _prefill(info, file)


def folder_verdict(result):
    """The verdict of a folder (examine_folder.inspect_folder's `result`): per table across the files it is stored
    in, as file_verdict, with the copies every session of the client holds together; and each tie config.json
    contradicts. A folder's --retie writes one data file holding each table once."""
    found, by_table = [], {}
    ties = [(it["file"], p) for it in result["items"] for p in it["info"].pairs
            if p.relation in ("shared",) + COPIES]
    for number, (file, p) in enumerate(ties):  # each table's pairs found once, not once a table
        by_table.setdefault((file, p.table), []).append(number)
    for v in result["across"]["vocabulary"]:
        held = v["in_memory"]["defaults"]["copies"]
        if v["tie_finding"]:
            found.append(_entry(v["tie_finding"], v, v["file"], (v["copies_on_disk"], held, v["wasted_bytes"]),
                                (None, _WHY_NOT[v["tie_finding"]])))
            continue
        kind = _kind(v["copies_on_disk"], held)
        if kind is None:
            continue
        names = {(m.item["file"], m.entry.initializer) for m in v["members"]}
        pairs = [ties[n][1] for n in sorted(n for name in names for n in by_table.get(name, []))]  # files' order
        files = {s["file"] for s in v["stored"]}
        widened = v["format"] if any(_widened(m.item["info"].runtime_copies, m.entry.initializer)
                                     for m in v["members"]) else None
        fix, why = _remedies(pairs, kind, widened) if pairs and len(files) == 1 else (RETIE, None)
        found.append(_entry(kind, v, v["file"], (v["copies_on_disk"], held, v["wasted_bytes"]), (fix, why)))
    return found + [e for it in result["items"] for e in quantized_copies(it["info"], it["file"]) +
                    _prefill(it["info"], it["file"])]


LOOKUP_FROM_HEAD = f"{RETIE} {FLAG}"
SHARED_INT8 = f"{RETIE} {int8share.FLAG}"


def quantized_copies(info, file):
    """The `quantized_copy` entries (informational) of a file: a float table whose values a quantized head holds
    as its codes (relations' head_lookup), with what --lookup-from-head would save (the float table on disk, and
    each copy of it a session holds), or why it cannot; `bits` and `max_error_in_scales` say what the rows would
    become (each element within that many of its quantization steps), `quantized` which side holds the codes;
    `shared_int8`, where the same pair can take the other way, {"fix": --shared-int8's, "saved_bytes_on_disk"}."""
    vocabulary = {v["table"]: v for v in info.vocabulary}
    found = []
    for p in info.pairs:
        answer, v = p.head_lookup, vocabulary.get(p.table)
        if answer is None or v is None:
            continue
        held = v["tables_in_memory"]
        quant = p.head_entry.quant or p.table_entry.quant
        found.append({**_entry("quantized_copy", v, file, (2, None, v["bytes"]), (LOOKUP_FROM_HEAD, answer.why_not)),
                      "wasted_bytes_in_memory": None if held is None else held * v["bytes"], "head": p.head,
                      "quantized": "head" if p.head_entry.quant else "table", "bits": quant.bits,
                      "max_error_in_scales": p.max_error_in_scales,  # built once, read by name after
                      "shared_int8": None if answer.why_not else {
                          "fix": SHARED_INT8,
                          "saved_bytes_on_disk": int8share.saved_bytes(info.model, p.table_entry, p.head_entry)}})
    return found


def _prefill(info, file):
    """The `all_positions_scored` entries (informational) of info.prefill (findings.prefill.all_positions): the
    logits rows a generating client does not read are the bytes it wastes in memory, at the stated prompt length;
    the fix, --retie OUT --logits-to-keep 1, where retie.keep can make one (else why not)."""
    found = info.prefill
    fix, why = keep.fix(info.model, info) if found else (None, None)
    return [{"kind": "all_positions_scored", "table": p["head"], "file": file, "copies_on_disk": None,
             "copies_in_memory": None, "wasted_bytes_on_disk": None,
             "wasted_bytes_in_memory": p["logits_bytes"] - p["row_bytes"], "fix": fix, "why_not": why,
             "prompt_tokens": p["prompt_tokens"], "logits_bytes": p["logits_bytes"], "output": p["output"],
             "counted": p.get("counted"), "timing": p.get("timing")}
            for p in found]
