"""A transformers.js folder's report: one client load per dtype variant (examine_folder.inspect_variants' findings),
each variant's verdict in words, then a short table of the variants; each variant's folder report under --verbose.
Nothing is counted or added across variants: a client opens one of them."""
from runtime.inspect import answer
from runtime.model.findings.across import disk_bytes
from runtime.model.findings.counting import human, times
from runtime.inspect.report.folder import folder_body, folder_json, verdict_lines
from runtime.inspect.verdict import FAILING


def token_table(result):
    """The token table of a variant (its folder's `across` vocabulary entry of kind token; the largest where there
    are several), or None where no lookup reads token ids."""
    tokens = [v for v in result["across"]["vocabulary"] if v["kind"] == "token"]
    return max(tokens, key=lambda v: v["bytes"], default=None)


def summary(found):
    """One variant ({"dtype", "result"}) as --json's `variants` lists it: {dtype, files, file_bytes, table,
    copies_on_disk, copies_in_memory, verdict}, the copies those of its token table (null where it has none;
    copies_in_memory null under --static), the verdict's entries each with its `dtype`."""
    dtype, result = found["dtype"], found["result"]
    table = token_table(result)
    return {"dtype": dtype, "files": [it["file"] for it in result["items"]], "file_bytes": disk_bytes(result["items"]),
            "table": table and table["table"], "copies_on_disk": table and table["copies_on_disk"],
            "copies_in_memory": table and table["in_memory"]["defaults"]["copies"],
            "verdict": [{**e, "dtype": dtype} for e in result["verdict"]]}


def variants_json(folder, found):
    """What --json prints of a transformers.js folder read whole: `model`, `verdict` (every variant's entries),
    `onnxruntime`, `rule`, and `variants`, each summary() plus `report`: its folder report's `rule`, `files` and
    `across_files` as --dtype would print them."""
    listed = []
    for f in found:
        report = folder_json(f["result"])
        listed.append({**summary(f), "report": {k: report[k] for k in ("rule", "files", "across_files")}})
    return {"model": folder, "verdict": [e for v in listed for e in v["verdict"]],
            "onnxruntime": found[0]["result"]["onnxruntime"] if found else None, "rule": rule(found),
            "variants": listed}


def rule(found):
    """Why the folder is read as these variants, in one line."""
    return (f"transformers.js's onnx/ layout: {len(found)} dtype variant(s) ({', '.join(f['dtype'] for f in found)}), "
            "each a client load of its own (a client opens one dtype's files)")


_COLUMNS = ("dtype", "files", "on disk", "token table on disk", "in a session")


def variants_report(folder, found, out, verbose=False):
    """The text report of a transformers.js folder read whole: each variant's verdict lines, named by its dtype;
    then one row per variant (its files, their bytes on disk, the copies of its token table on disk and in a
    session under onnxruntime's defaults); each variant's folder report under `verbose`."""
    w = lambda text: out.write(answer.line(text) + "\n")
    entries = [summary(f) for f in found]
    said = {}  # a finding's lines: the dtypes that have it, in order
    failing = {f["dtype"]: [e for e in entry["verdict"] if e["kind"] in FAILING] for f, entry in zip(found, entries)}
    for f in found:  # each variant's answer; all well where none has one (else the table's rows say so)
        if failing[f["dtype"]] or not any(failing.values()):
            for block in _blocks(verdict_lines(f["result"], failing[f["dtype"]])):
                said.setdefault(block, []).append(f["dtype"])
    for f, entry in zip(found, entries):  # then the informational lines
        for block in _blocks(_informational(f, entry)):
            said.setdefault(block, []).append(f["dtype"])
    for block, dtypes in said.items():
        w(f"{', '.join(dtypes)}: {block[0]}")
        for line in block[1:]:
            w(line)
    w("")
    w(f"{folder}: {len(found)} dtype{'s' if len(found) != 1 else ''}, a client loads one")
    rows = [_COLUMNS] + [_row(entry) for entry in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    for r in rows:
        w("  " + "  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip())
    if any(f["result"]["onnxruntime"] is None for f in found):
        w("  (--static: what a session holds is not counted)")
    for f in found:
        if verbose:
            w("")
            w(f"== {f['dtype']}")
            folder_body(f["result"], out, verbose=True)
    w(answer.FOOTER)


def _informational(found, entry):
    """A variant's informational lines (a float table its head holds again as codes; a head that scores every
    prompt position, called the head: names and files are its folder report's, under --verbose)."""
    vocabulary = {v["table"]: v for v in found["result"]["across"]["vocabulary"]}
    return answer.quantized(entry["verdict"], vocabulary, False) + \
        answer.scored(entry["verdict"], False, named=False)


def _blocks(lines):
    """`lines` as findings: each a tuple of its first line and the indented lines under it. Variants with the same
    finding are named together before it once."""
    blocks = []
    for line in lines:
        if line.startswith(" ") and blocks:
            blocks[-1].append(line)
        else:
            blocks.append([line])
    return [tuple(b) for b in blocks]


def _row(entry):
    """A variant's row: dtype, how many files, bytes on disk, its token table's copies on disk and in a session."""
    copies = lambda n: "-" if n is None else times(n)
    held = "not run" if entry["copies_in_memory"] is None and entry["table"] else copies(entry["copies_in_memory"])
    return (entry["dtype"], str(len(entry["files"])), human(entry["file_bytes"]), copies(entry["copies_on_disk"]),
            held)
