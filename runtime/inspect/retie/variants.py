"""--retie OUT for a transformers.js folder read whole: every dtype variant is planned as the client load it is
(folder.planned_files), all of them are staged as one new transformers.js folder OUT, each file with
data files of its own (transformersjs.py) and config.json's use_external_data_format naming every file that has
them. A variant --retie has nothing to rewrite in (each table held once, or held twice in a form it does not
rewrite) is written as it is: the same graph and values, its data laid out as transformers.js reads it. Each
rewritten file is proven where OUT's staging folder holds it (folder.proven_files), and OUT placed last."""
import os

from graphs.together import chunk_names
from runtime.model.findings.across import disk_bytes
from runtime.model.read import sidecars
from runtime.model.read.layout import transformersjs_root
from runtime.model.read.text import InspectError
from runtime.inspect.retie import keep as keeps
from runtime.inspect.retie import transformersjs
from runtime.inspect.retie import lines, outcomes
from runtime.inspect.retie.folder import StagedOut, planned_files, proven_files
from runtime.inspect.retie.write import Asked


def retie_variants(found, out, scratch, limits, say, asked=Asked()):
    """Retie every variant of `found` (analysis.analyse's, each variant's result with its `verdict`)
    into the new folder `out`; the exit status: 0 written (or nothing to do), 1 a variant's proof failed (nothing
    written). `asked`: write.Asked's --logits-to-keep (for each variant with a file whose head scores every prompt
    position; InspectError where none has) and --lookup-from-head. Every variant is planned, OUT staged beside its name, each rewritten
    file proven there, and OUT renamed into place last."""
    logits_to_keep = asked.logits_to_keep
    keeping = _keeping(found, logits_to_keep, say)
    planned = []
    for f in found:
        said = lambda line, dtype=f["dtype"]: say(line.replace("retie: ", f"retie: {dtype}: ", 1))
        files = planned_files(f["result"], said, keeping[f["dtype"]], asked.lossy)
        planned.append({"found": f, "files": files, "changed": any(x.plan for x in files), "said": said})
    if not any(p["changed"] for p in planned):
        say("retie: nothing to do: no variant holds a table twice in a form --retie rewrites (any left is named "
            "above)\n")
        return 0
    for p in planned:
        if not p["changed"]:
            say(f"retie: {p['found']['dtype']}: written as it is: {_why_left(p['found']['result']['verdict'])}\n")
    root = transformersjs_root(found[0]["result"]["folder"])[0]
    every = [x for p in planned for x in p["files"]]
    config = transformersjs.Config(root, [x.name for x in every], say)
    staged, said = StagedOut(every, out, config), []
    try:
        for i, p in enumerate(planned):
            where = os.path.join(scratch, f"retie-{i}")
            os.mkdir(where)
            p["proven"] = proven_files(p["files"], staged, where, limits, p["said"],
                                       asked._replace(logits_to_keep=keeping[p["found"]["dtype"]]))
            if p["proven"] is None:
                return 1
            p["scratch"] = where
        dtypes = ", ".join(p["found"]["dtype"] for p in planned)
        said.append(f"retie: wrote {out}: {len(planned)} dtype variant(s) ({dtypes}), {len(every)} file(s), each "
                     f"with its own data file(s) <file>_data (transformers.js's layout{config.said()})\n")
        for p in planned:
            _said_after(p, staged, limits, said.append)
        where = [os.path.dirname(x.name) for x in every]
        said += [f"retie: {line}\n" for line in sidecars.copy_into(root, staged.root(), where, skip=config.names())]
        staged.place(limits)
    finally:
        staged.discard()
    for line in said:
        say(line)
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


def _said_after(p, staged, limits, say):
    """A variant's bytes on disk before -> after, then, where it was rewritten, what its files in OUT (`staged`, a
    folder.StagedOut) hold, measured (outcomes.measured_again)."""
    dtype, result = p["found"]["dtype"], p["found"]["result"]
    written = staged.written()
    after = sum(os.path.getsize(staged.path(n)) for x in p["files"] for n in [x.name] + chunk_names(written, x.name))
    before = disk_bytes(result["items"])
    say(f"retie: {dtype}: {', '.join(x.name for x in p['files'])}: {lines.on_disk(before, after)}\n")
    if not p["changed"]:  # written as it is (said): what its sessions hold is as the report said
        return
    said = lambda line: say(line.replace("retie: ", f"retie: {dtype}: ", 1))
    outcomes.measured_again(result, staged, p["proven"], p["scratch"], limits, said, after)
