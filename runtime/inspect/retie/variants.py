"""--retie OUT for a transformers.js folder read whole: every dtype variant is retied and proven as the client load
it is (folder.proven_files), then all of them are written into one new transformers.js folder OUT, each file with
data files of its own (transformersjs.py) and config.json's use_external_data_format naming every file that has
them. A variant --retie has nothing to rewrite in (each table held once, or held twice in a form it does not
rewrite) is written as it is: the same graph and values, its data laid out as transformers.js reads it."""
import os

from graphs.together import chunk_names, save_together
from runtime.model.findings.across import disk_bytes
from runtime.model.findings.counting import human
from runtime.model.read import sidecars
from runtime.model.read.layout import transformersjs_root
from runtime.model.read.text import InspectError
from runtime.inspect.retie import keep as keeps
from runtime.inspect.retie import transformersjs
from runtime.inspect.retie.folder import data_name, disk_change, measured_again, placed, proven_files


def retie_variants(found, out, scratch, limits, say, logits_to_keep=None):
    """Retie every variant of `found` (analysis.analyse's, each variant's result with its `verdict`)
    into the new folder `out`; the exit status: 0 written (or nothing to do), 1 a variant's proof failed (nothing
    written). `logits_to_keep`: --logits-to-keep's K, for each variant with a file whose head scores every prompt
    position; InspectError where none has."""
    keeping = _keeping(found, logits_to_keep, say)
    proven = []
    for i, f in enumerate(found):
        where, held = os.path.join(scratch, f"retie-{i}"), {}
        os.mkdir(where)
        said = lambda line, dtype=f["dtype"]: say(line.replace("retie: ", f"retie: {dtype}: ", 1))
        done = proven_files(f["result"], where, limits, said, keeping[f["dtype"]], held)
        if done is None:
            return 1
        proven.append({"found": f, "models": done[0], "changed": done[1], "held": held, "scratch": where})
    if not any(p["changed"] for p in proven):
        say("retie: nothing to do: no variant holds a table twice in a form --retie rewrites (any left is named "
            "above)\n")
        return 0
    for p in proven:
        if not p["changed"]:
            say(f"retie: {p['found']['dtype']}: written as it is: {_why_left(p['found']['result']['verdict'])}\n")
    root = transformersjs_root(found[0]["result"]["folder"])[0]
    written, config = _write(proven, out, root, limits, say)
    for p in proven:
        _said_after(p, out, written, limits, say)
    where = [os.path.dirname(name) for p in proven for name, _, _ in p["models"]]
    for line in sidecars.copy_into(root, out, where, skip=config.names()):
        say(f"retie: {line}\n")
    return 0


def _keeping(found, logits_to_keep, say):
    """{dtype: the K its files are rewritten with, or None}: --logits-to-keep for each variant one of whose files
    can keep the last positions (retie.keep), the others' reason said; InspectError where no variant can."""
    if logits_to_keep is None:
        return {f["dtype"]: None for f in found}
    keeping, reasons = {}, {}
    for f in found:
        why = [keeps.why_not(it["model"], it["info"]) for it in f["result"]["items"]]
        keeping[f["dtype"]] = None if all(why) else logits_to_keep
        if all(why):
            reasons[f["dtype"]] = why[0]
    if len(reasons) == len(found):
        raise InspectError("--logits-to-keep: no variant of the folder can keep the last positions "
                           f"({'; '.join(f'{dtype}: {why}' for dtype, why in reasons.items())})")
    for dtype, why in reasons.items():
        say(f"retie: {dtype}: --logits-to-keep left out: {why}\n")
    return keeping


def _why_left(verdict):
    """Why a variant is written as it is, in a few words: the reason its `verdict` gives for its first failing entry
    with one (remedy()'s, or why no head can read the table), else that every table is held once."""
    failing = [e for e in verdict if e["kind"] != "all_positions_scored"]  # informational: not why
    why = next((e["why_not"] for e in failing if e["why_not"]), None)
    if why:
        return f"{failing[0]['table']}: {why}"
    return ("nothing in it --retie rewrites (said above)" if failing else
            "every table held once (no --retie needed)")


def _write(proven, out, root, limits, say):
    """Every variant's files written into OUT at once (graphs.together.save_together in transformers.js's layout,
    config.json naming each file's data chunks): (the paths written, the transformersjs.Config)."""
    limits.progress(f"writing {out}")
    models = []
    for p in proven:
        place = placed(p["found"]["result"])
        p["models"] = [(place[name], proto, sources) for name, proto, sources in p["models"]]
        models += p["models"]
    names = [name for name, _, _ in models]
    config = transformersjs.Config(root, names, say)
    try:
        written = save_together(models, out, data_name(names), chunk_bytes=transformersjs.CHUNK_BYTES,
                                then=config.written)
    except ValueError as e:  # a name that would leave OUT (the layout's are checked before: never, by design)
        raise InspectError(f"--retie {out}: {e}; nothing written") from None
    limits.committing()  # OUT is in place: what is left (these lines, the sidecars) is not cut off by the deadline
    dtypes = ", ".join(p["found"]["dtype"] for p in proven)
    say(f"retie: wrote {out}: {len(proven)} dtype variant(s) ({dtypes}), {len(models)} file(s), each with its own "
        f"data file(s) <file>_data (transformers.js's layout{config.said()})\n")
    return written, config


def _said_after(p, out, written, limits, say):
    """A variant's bytes on disk before -> after, then, where it was rewritten, what its files in OUT hold, measured
    (folder.measured_again)."""
    dtype, result = p["found"]["dtype"], p["found"]["result"]
    mine = [os.path.join(out, name) for name, _, _ in p["models"]]
    after = sum(os.path.getsize(path) for m in mine for path in [m] + chunk_names(written, m))
    before = disk_bytes(result["items"])
    say(f"retie: {dtype}: {', '.join(name for name, _, _ in p['models'])}: {human(before)} -> {human(after)} on disk "
        f"({disk_change(before, after)})\n")
    if not p["changed"]:  # written as it is (said): what its sessions hold is as the report said
        return
    said = lambda line: say(line.replace("retie: ", f"retie: {dtype}: ", 1))
    measured_again(result, out, p["held"], p["scratch"], limits, said, after)
