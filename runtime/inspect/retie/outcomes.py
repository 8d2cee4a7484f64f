"""What --retie OUT of a folder says once OUT is written: its files measured again in one process holding every
session, beside what the folder held, and a line per table the folder held more than once, before -> after."""
import os

import onnx
from onnx import TensorProto

from runtime.model.findings import counting
from runtime.model.findings.counting import DEFAULTS, human
from runtime.model.read.layout import transformersjs_root
from runtime.inspect.retie import lines
from runtime.inspect.sandbox import jobs, memory


def placed(result):
    """{file: its name in OUT} of the folder `result` describes: its own name, but a transformers.js folder read
    from onnx/ is written whole, in its root's layout (onnx/<file>)."""
    tjs = transformersjs_root(result["folder"])
    return {it["file"]: os.path.join(tjs[1], it["file"]) if tjs else it["file"] for it in result["items"]}


def measured_again(result, staged, proven, scratch, limits, say, size=None):
    """Once OUT is written (`staged`, a folder.StagedOut): the files of `result` there measured in one process
    holding every session (or, for the one file with a table, by its proof: folder.Proven's figures), said beside
    what the folder held (_say_memory), then a line per table the folder held more than once (_outcomes; `proven`'s
    held, what each rewritten file's proof counted). `size`: the bytes of those files in OUT (default: all of OUT's)."""
    place = placed(result)
    parts = [jobs.part(jobs.tool_model(staged.path(place[it["file"]])), it["info"].rows, it["info"].shape)
             for it in result["items"] if it["info"].rows]
    if proven.figures is not None and len(parts) == 1:
        measured = {"defaults": proven.figures}
    else:
        measured = memory.measure_together(parts, scratch, limits, size or staged.bytes(), DEFAULTS) if parts else {}
    _say_memory(result["across"]["vocabulary"], measured, say)
    after = (measured.get("defaults") or {}).get("resident_bytes")
    for line in _outcomes(result, staged.root(), proven.held, place,
                          per_file=transformersjs_root(result["folder"]) is not None, after=after):
        say(line)


def _say_memory(vocabulary, measured, say):
    """One line: the Pss one process holding every session grew by, before and after (and with prepacking off,
    where that was measured); then each table held more than once before."""
    on, off = measured.get("defaults"), measured.get("no_prepacking")
    was = next((v["in_memory"]["defaults"] for v in vocabulary), None)
    if on is None or was is None or was["resident_bytes"] is None:
        say(f"retie: not measured in one process{': ' + measured['error'] if 'error' in measured else ''}\n")
        return
    largest = max((v["bytes"] for v in vocabulary), default=0)
    if largest < counting.RESOLUTION:  # a session's own pages move by more than such a table between runs
        say(f"retie: in one process holding every session: resident (Pss) {on['resident_bytes'] / 2**20:+.1f} MiB "
            f"after a run of each, was {was['resident_bytes'] / 2**20:+.1f}: the largest table, "
            f"{human(largest)}, is too small to show in it (copies counted below)\n")
        return
    say(f"retie: in one process holding every session, under onnxruntime's default SessionOptions: "
        f"{on['resident_bytes'] / 2**20:+.1f} MiB Pss after a run of each (was {was['resident_bytes'] / 2**20:+.1f}"
        + (f"; {off['resident_bytes'] / 2**20:.1f} with {counting.NO_PREPACKING}" if off else "") + ")\n")



def _stored_after(out, names):
    """How many distinct stored tensors the (file, initializer) `names` are in the files written to `out`: a data
    file's range once however many names it, a tensor in a model file once each; names gone (a head now reading
    the table) are not counted."""
    places = set()
    for file, name in names:
        model = onnx.load(os.path.join(out, file), load_external_data=False)
        for t in model.graph.initializer:
            if t.name != name:
                continue
            where = {e.key: e.value for e in t.external_data}
            places.add((os.path.dirname(file), where["location"], where.get("offset", "0"))
                       if t.data_location == TensorProto.EXTERNAL else (file, name))
    return len(places)


def _outcomes(result, out, held, place, per_file=False, after=None):
    """One line per table the folder held more than once: stored and held before -> after, and the bytes saved.
    After, on disk: the files written, read back; in memory: each file's copies as its proof counted them (held:
    {file: {table: copies}}) or, for a file left as it was, as its report did; the copies one mapped range of the
    shared data file counts once, plus each file's beyond it, or, with `per_file` (each file has data of its own:
    transformers.js's layout, each place a table is stored mapped by its own session), every file's added up.
    `after`: the resident growth one process holding OUT's sessions measured (lines.not_resident)."""
    for v in result["across"]["vocabulary"]:
        was = v["in_memory"]["defaults"]["copies"]
        if not (v["copies_on_disk"] > 1 or (was or 0) > 1):
            continue
        names = {(place[m.item["file"]], m.entry.initializer) for m in v["members"]}
        names |= {(place[m.item["file"]], t) for m in v["members"] for t in held.get(m.item["file"], {})
                  if t.startswith(m.entry.initializer + "_rows")}  # stored anew under retie.rewrite's name for it
        on_disk = _stored_after(out, names)
        each = []  # the copies each file's session holds
        for it in result["items"]:
            mine = {m.entry.initializer for m in v["members"] if m.item is it}
            if not mine:
                continue
            counted = [n for t, n in held.get(it["file"], {}).items() if t in mine]
            reported = [e["tables_in_memory"] or 1 for e in it["info"].vocabulary if e["table"] in mine]
            each.append((counted or reported or [1])[0])
        now = sum(each) if per_file else 1 + sum(max(n - 1, 0) for n in each)
        saved = max((was or 0) - now, 0) * v["bytes"]
        resident = lines.not_resident(saved, v["in_memory"]["defaults"].get("resident_bytes"), after, " (counted)")
        yield lines.outcome_line(v["table"], (v["copies_on_disk"], on_disk), (was, now), v["bytes"],
                                 "the client's process", v.get("format"), (resident, "")) + "\n"
