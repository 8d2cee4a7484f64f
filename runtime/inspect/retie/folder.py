"""--retie OUT for a folder: each file the client loads is retied and proven as a file (retie.planned / proven),
then every one of them is written into the new folder OUT with one data file they share (graphs.together: a
table several files hold is stored there once, at one aligned offset every file names), the sidecars are copied,
and OUT is measured again in one process holding every session. A transformers.js folder is written as
transformers.js reads one (transformersjs.py): each file with data files of its own, config.json saying so."""
import os

import onnx
from onnx import TensorProto

from graphs.together import save_together
from runtime.bounds import NARROW
from runtime.model.findings import counting
from runtime.model.findings.across import disk_bytes
from runtime.model.findings.counting import DEFAULTS, human, times
from runtime.model.findings.relations import stored_as_table
from runtime.model.read import sidecars
from runtime.model.read.layout import transformersjs_root
from runtime.model.read.text import InspectError
from runtime.inspect.retie.edits import external_sources
from runtime.inspect.retie.rewrite import borrow
from runtime.inspect.retie import transformersjs
from runtime.inspect.retie import keep as keeps
from runtime.inspect.retie.write import Plan, kept_line, planned_keeping, proven_in_place, rewritten_line, widened_note
from runtime.inspect.sandbox import memory

DATA = "model.data"  # the one data file OUT's models share


def retie_folder(result, out, scratch, limits, say, logits_to_keep=None):
    """Retie the folder `result` describes (folder.inspect_folder) into the new folder `out`; the exit status: 0
    written (or nothing to do), 1 a file's proof failed (nothing written). `logits_to_keep`: --logits-to-keep's K,
    for each file whose head scores every prompt position (retie.keep)."""
    held = {}
    proven = proven_files(result, scratch, limits, say, logits_to_keep, held)
    if proven is None:
        return 1
    models, changed = proven
    pairs = result["across"]["pairs"]
    tjs = transformersjs_root(result["folder"])  # (root, where its files lie) of a transformers.js folder, or None
    place = placed(result)
    merges = not tjs and any(p["relation"] == "duplicate" for p in pairs)  # what one shared data file would merge
    if not changed and not merges:
        say("retie: nothing to do: no table is held twice in a form --retie rewrites (any left is named above)\n")
        return 0
    limits.progress(f"writing {out}")
    models = [(place[name], proto, sources) for name, proto, sources in models]
    config = transformersjs.Config(tjs[0], [name for name, _, _ in models], say) if tjs else None
    data = data_name([name for name, _, _ in models])
    try:
        written = save_together(models, out, data, **({"chunk_bytes": transformersjs.CHUNK_BYTES,
                                                        "then": config.written} if tjs else {}))
    except ValueError as e:  # a name that would leave OUT (the layout's are checked before: never, by design)
        raise InspectError(f"--retie {out}: {e}; nothing written") from None
    limits.committing()  # OUT is in place: what is left (these lines, the sidecars) is not cut off by the deadline
    before = disk_bytes(result["items"])
    sidecar = {os.path.join(out, n) for n in config.names()} if tjs else set()  # config.json, written with OUT
    after = sum(os.path.getsize(p) for p in written if p not in sidecar)
    shared = (f", each with its own data file(s) <file>_data (transformers.js's layout{config.said()})" if tjs else
              f" and one {data} they share")
    say(f"retie: wrote {out}: {len(models)} file(s){shared}: {human(before)} -> {human(after)} on "
        f"disk ({disk_change(before, after)})\n")
    measured_again(result, out, held, scratch, limits, say, after)
    # the sidecars at the folder's top (config.json beside transformers.js's onnx/ too, its root's when read from
    # onnx/) and beside the files; every file keeps its name, so genai_config.json is copied naming the files it
    # named, as they resolve
    top = tjs[0] if tjs else result["folder"]
    where = [os.path.dirname(name) for name, _, _ in models]
    for line in sidecars.copy_into(top, out, where, skip=config.names() if tjs else ()):
        say(f"retie: {line}\n")
    return 0


def placed(result):
    """{file: its name in OUT} of the folder `result` describes: its own name, but a transformers.js folder read
    from onnx/ is written whole, in its root's layout (onnx/<file>)."""
    tjs = transformersjs_root(result["folder"])
    return {it["file"]: os.path.join(tjs[1], it["file"]) if tjs else it["file"] for it in result["items"]}


def measured_again(result, out, held, scratch, limits, say, after):
    """Once OUT is written (`after` bytes, of the files of `result` there): its files measured in one process holding
    every session, said beside what the folder held (_say_memory), then a line per table the folder held more than
    once (_outcomes; `held` what each rewritten file's proof counted)."""
    place = placed(result)
    parts = [{"model": os.path.join(out, place[it["file"]]), "rows": it["info"]["rows"], "shape": it["info"]["shape"]}
             for it in result["items"] if it["info"]["rows"]]
    measured = memory.measure_together(parts, scratch, limits, after, DEFAULTS) if parts else {}
    _say_memory(result["across"]["vocabulary"], measured, say)
    for line in _outcomes(result, out, held, place, per_file=transformersjs_root(result["folder"]) is not None):
        say(line)


def proven_files(result, scratch, limits, say, logits_to_keep, held):
    """([(name, ModelProto, sources)] of every file, how many were rewritten), each rewritten file proven first
    (what its session holds put in `held`), or None when a proof failed (said; nothing is to be written)."""
    models, changed = [], 0
    borrowed, fed = _borrowed_tables(result, say), upstream(result["items"])
    keeping = _keeping(result["items"], logits_to_keep, say)
    for i, item in enumerate(result["items"]):
        model, info, name = item["model"], item["info"], item["file"]
        said = lambda line, name=name: say(line.replace("retie: ", f"retie: {name}: ", 1))
        rewritten, sources, keep = planned_keeping(model, info, said, logits_to_keep if name in keeping else None)
        for head, owner, table in borrowed.get(name, []):
            rewritten.append(borrow(model, sources, head, owner["model"], table))
        if rewritten or keep:
            where = os.path.join(scratch, f"retie{i}")
            os.mkdir(where)
            plan = Plan(model, info, rewritten, sources, keep)
            _, held[name], failures, weights, _ = proven_in_place(plan, where, limits, said, fed[name])
            # a table stored anew (genai's [width, vocab] one, as "<name>_rows") counted under its old name too
            held[name].update({r.table: held[name][r.now] for r in rewritten if r.now in held[name]})
            if failures:
                say(f"retie: {name}: " + (failures[0] if failures[0].startswith("failed") else
                                          f"not proven, nothing written: {failures[0]}") + "\n")
                return None
            if rewritten:
                say(rewritten_line(rewritten, model, info["shape"], f"{name}: ", fed[name], weights))
            if keep:
                say(kept_line(keep, logits_to_keep, info["shape"], f"{name}: ", any(r.hidden for r in rewritten)))
            changed += 1
        else:  # as it is, its external tensors read from their files as they are written
            sources = external_sources(model)
        models.append((name, model.proto, sources))
    return models, changed


def _keeping(items, logits_to_keep, say):
    """The files --logits-to-keep rewrites: each whose head scores every prompt position (a decoder); the others'
    reasons said where they have a head. InspectError where no file can (nothing written)."""
    if logits_to_keep is None:
        return set()
    why = {it["file"]: keeps.why_not(it["model"], it["info"]) for it in items}
    for name, reason in why.items():
        if reason and not reason.startswith("no logits head") and any(w is None for w in why.values()):
            say(f"retie: {name}: --logits-to-keep left out: {reason}\n")
    if all(why.values()):
        reasons = [f"{name}: {reason}" for name, reason in why.items()]
        raise InspectError("--logits-to-keep: no file of the folder can keep the last positions "
                           f"({'; '.join(reasons)})")
    return {name for name, reason in why.items() if reason is None}


def disk_change(before, after):
    """'saved N' or 'N bytes more' (alignment padding can outweigh a small table): never a negative saving."""
    return f"saved {human(before - after)}" if after <= before else f"{human(after - before)} more"


def data_name(files):
    """The name of the data file OUT's models share: DATA, unless a model file of that name is among `files` (a
    decoder called model.data), then the first free one of model.data.1, .2, ..."""
    taken = {os.path.basename(f) for f in files}
    return next(n for n in [DATA] + [f"{DATA}.{i}" for i in range(1, len(taken) + 2)] if n not in taken)


FED = {"encoder_hidden_states": "last_hidden_state"}  # a decoder's input -> the encoder output it is (Optimum)


def upstream(items):
    """{file: [{input, output, checked, rows, shape}]}: each input of a file that another file of the folder makes
    (an output of the same name, as embed_tokens.onnx makes a split decoder's inputs_embeds; or FED's), so that the
    proof feeds what the client feeds (proof._fed_from)."""
    outputs = {o.name: it for it in items for o in it["model"].proto.graph.output}
    fed = {}
    for it in items:
        fed[it["file"]] = []
        for value in it["model"].proto.graph.input:
            made = FED.get(value.name, value.name)
            maker = outputs.get(made)
            if maker is not None and maker is not it:
                fed[it["file"]].append({"input": value.name, "output": made, "checked": maker["model"].checked,
                                        "rows": maker["info"]["rows"], "shape": maker["info"]["shape"]})
    return fed


def _borrowed_tables(result, say):
    """{file: [(head entry, the item whose file holds the table, table entry)]}: each float32 head of a token table
    in a file that looks none of that table's rows up (a split decoder beside embed_tokens.onnx), whose values are
    the table's (a duplicate, or a transposed one) but stored apart. Such a head is pointed at the table itself
    (borrow); any other is said to be left, and why."""
    borrowed = {}
    for group in result["across"]["vocabulary"]:
        if group["kind"] != "token":
            continue
        owner, table, _ = next(m for m in group["members"] if m[2] == "lookup")
        looked_up = {it["file"] for it, _, role in group["members"] if role == "lookup"}
        for item, head, role in group["members"]:
            if role != "head" or item["file"] in looked_up or head["initializer"] == table["initializer"] and \
                    item is owner:
                continue
            why = _why_not_borrowed(table, head)
            if why:
                say(f"retie: {owner['file']} {table['initializer']} / {item['file']} {head['initializer']} (a copy "
                    f"across files): left as it is ({why})\n")
            else:
                borrowed.setdefault(item["file"], []).append((head, owner, table))
    return borrowed


def _why_not_borrowed(table, head):
    if table["format"] != "float32" or head["format"] != "float32":
        fmt = head["format"] if head["format"] != "float32" else table["format"]
        return f"{'an' if fmt[0] in 'aeiu' else 'a'} {fmt} copy: --retie points float32 heads at another file's table"
    if not stored_as_table(table):
        return "the table is stored [width, vocab]"
    if head.get("graph", "main") != "main" and not all(
            step.endswith((".then_branch", ".else_branch")) for step in head["graph"].split("/")[1:]):
        return f"read inside a Loop or Scan body ({head['graph']})"
    if "Reshape" in head["views"]:
        return "read through a Reshape that is not the table's own shape"
    return None


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


def _outcomes(result, out, held, place, per_file=False):
    """One line per table the folder held more than once: stored and held before -> after, and the bytes saved.
    After, on disk: the files written, read back; in memory: each file's copies as its proof counted them (held:
    {file: {table: copies}}) or, for a file left as it was, as its report did; the copies one mapped range of the
    shared data file counts once, plus each file's beyond it, or, with `per_file` (each file has data of its own:
    transformers.js's layout, each place a table is stored mapped by its own session), every file's added up."""
    for v in result["across"]["vocabulary"]:
        was = v["in_memory"]["defaults"]["copies"]
        if not (v["copies_on_disk"] > 1 or (was or 0) > 1):
            continue
        names = {(place[it["file"]], e["initializer"]) for it, e, _ in v["members"]}
        names |= {(place[it["file"]], t) for it, e, _ in v["members"] for t in held.get(it["file"], {})
                  if t.startswith(e["initializer"] + "_rows")}  # stored anew under retie.rewrite's name for it
        on_disk = _stored_after(out, names)
        each = []  # the copies each file's session holds
        for it in result["items"]:
            mine = {e["initializer"] for i, e, _ in v["members"] if i is it}
            if not mine:
                continue
            counted = [n for t, n in held.get(it["file"], {}).items() if t in mine]
            reported = [e["tables_in_memory"] or 1 for e in it["info"]["vocabulary"] if e["table"] in mine]
            each.append((counted or reported or [1])[0])
        after = sum(each) if per_file else 1 + sum(max(n - 1, 0) for n in each)
        saved = [f"{human((v['copies_on_disk'] - on_disk) * v['bytes'])} on disk"] if v["copies_on_disk"] > on_disk else []
        saved += [f"{human((was - after) * v['bytes'])} in memory (counted)"] if was is not None and was > after else []
        stored = (f"stored {times(v['copies_on_disk'])} -> {times(on_disk)}" if v["copies_on_disk"] != on_disk else
                  f"stored {times(on_disk)}")
        widened = widened_note(v["format"]) if after > 1 and v.get("format") in NARROW else ""
        yield (f"retie: {v['table']}: {stored}, held {'?' if was is None else times(was)} -> {times(after)} by the "
               f"client's process under onnxruntime's defaults{'; saved ' + ', '.join(saved) if saved else ''}"
               f"{widened}\n")
