"""A model is a folder: each file the client loads examined, then the files related and measured together; a
transformers.js folder is one such folder per dtype variant."""
import os
import shutil

from runtime.inspect import examine
from runtime.model.findings import counting
from runtime.model.findings.counting import DEFAULTS, SETTINGS
from runtime.model.findings.across import config_tie, held_together, quantized_heads, relate_files, tie_finding
from runtime.model.findings.copies import widened_others
from runtime.model.read import paths as read_paths
from runtime.model.read.layout import client_files, variants
from runtime.inspect.sandbox import isolated, jobs, memory
from runtime.resident import OWNED_MOST


def _examined(folder, files, scratch, limits, proof_past, settings):
    """([{file, model, info}], what one process holding every session measured): each file examined (examine), its
    session not measured alone. Where the defaults are measured, one child opens every file's session as the client
    does, each writing its optimized model's layout as it opens, and measures them together (Pss) while this process
    relates the files (_measured_with_layouts); otherwise (or where onnxruntime refuses that run) the files'
    optimized models are built side by side where the machine has the cores and the memory, then the sessions
    measured together, alone: a child mapping the same files (or onnxruntime's library) meanwhile would change the
    Pss measured."""
    where = [os.path.join(scratch, f"file{i}") for i in range(len(files))]
    for path in where:
        os.mkdir(path)
    paths = [os.path.join(folder, name) for name in files]
    root = read_paths.root_of(folder)  # each file must still lie there when it is opened
    together = os.path.join(scratch, "together")
    os.mkdir(together)
    exams = [examine.start(p, w, limits, proof_past, measure=(), root=root, child=False) for p, w in zip(paths, where)]
    total = sum(e.model.file_bytes for e in exams)  # their data files' too
    for e in exams:
        e.watch([t for other in exams for t in other.tables])
    if "defaults" in settings and not memory.too_large(total):
        found = _measured_with_layouts(exams, together, limits, total, settings)
        if found is not None:
            return _items(files, found[0]), found[1]
        for path in where:  # what that child wrote, gone before each file is built and measured in turn
            shutil.rmtree(path)
            os.mkdir(path)
    if isolated.side_by_side(total, len(paths)):
        started = []
        try:
            for path, scratch_of in zip(paths, where):
                started.append(examine.start(path, scratch_of, limits, proof_past, measure=(), root=root))
            infos = [s.finish() for s in started]
        finally:
            for s in started:
                s.stop()
    else:
        infos = [examine.inspect_model(p, w, limits, proof_past, measure=(), root=root) for p, w in zip(paths, where)]
    parts = [jobs.part(jobs.user_model(i.model.checked), i.rows, i.shape) for i in infos if i.rows]
    return _items(files, infos), memory.measure_together(parts, together, limits, total, settings) if parts else {}


def _measured_with_layouts(exams, together, limits, total, settings):
    """([each Examination's inspect_model Findings], the measured figures) from one measure_together child that also
    writes the layouts of the files it runs (those with a table; the others get an optimizing child each, beside
    it), the files related meanwhile; None where onnxruntime refuses that run, so that the caller builds and
    measures each file in turn and reports the failure as it would. The defaults are measured again, without
    layouts, where writing one held more than resident.OWNED_MOST; the other settings in `settings` after."""
    runs = [e for e in exams if e.rows]
    child = isolated.start(jobs.measure_together([e.part() for e in runs], together, SETTINGS["defaults"]),
                           "running every file once in one process (defaults), writing their optimized models' "
                           "layouts", limits, total)
    try:
        for e in exams:
            if not e.rows:
                e.begin()
        for e in exams:
            e.relate()
        try:
            answer = child.result()
        except isolated.StepFailed:
            return None
        layouts = dict(zip(map(id, runs), answer.layouts))
        infos = [e.finish(layouts.get(id(e))) if e.rows else e.finish() for e in exams]
    finally:
        child.stop()
        for e in exams:
            e.stop()
    again = ["defaults"] if any(a.owned_bytes > OWNED_MOST for a in layouts.values()) else []
    measured = {} if again else {"defaults": answer.figures._asdict()}
    rest = again + [s for s in settings if s != "defaults"]
    if rest:
        parts = [jobs.part(jobs.user_model(e.model.checked), e.rows, e.shape) for e in runs]
        measured.update(memory.measure_together(parts, together, limits, total, rest))
    return infos, measured


def _items(files, infos):
    return [{"file": name, "model": info.model, "info": info} for name, info in zip(files, infos)]


def widened(group, items):
    """What the CPU provider's float32 widenings of each file's other weights (not the group's tensors) add
    beyond those weights as stored (findings.copies.widened_others): the memory ratio counts them as held."""
    return sum(widened_others(it["model"], it["info"].runtime_copies,
                              {m.entry.initializer for m in group["members"] if m.item is it}) for it in items)


def inspect_folder(folder, scratch, limits, proof_past=None, chosen=None, static=False, settings=DEFAULTS):
    """Everything a folder's report shows: {folder, rule, items: [{file, model, info}], across: relate_files' with
    each vocabulary entry's in_memory, config_tie and tie_finding, onnxruntime}. `chosen`: the names --files gave,
    or --dtype's name (a str: that variant of a transformers.js folder). Each file gets a folder of its own in
    `scratch`; `static`: onnxruntime is never started (nothing counted in memory); `settings`: the
    counting.SETTINGS the files' sessions are measured under, together."""
    files, rule = client_files(folder, dtype=chosen) if isinstance(chosen, str) else client_files(folder, chosen)
    if static:  # from the files alone: nothing is written, so no scratch folder is made
        root = read_paths.root_of(folder)
        items, measured = _items(files, [examine.inspect_model(os.path.join(folder, name), None, limits, proof_past,
                                                               static=True, root=root) for name in files]), {}
    else:
        items, measured = _examined(folder, files, scratch, limits, proof_past, settings)
    across = relate_files(items)
    config = config_tie(folder)
    weights = sum(t.nbytes for it in items for t in it["model"].tensors.values())
    for group in across["vocabulary"]:
        stored = sum(s["bytes"] for s in group["stored"])
        others = weights - stored + widened(group, items)  # the other weights as the sessions hold them
        group["in_memory"] = counting.not_counted() if static else held_together(group, items, measured, others)
        group["config_tie"] = config if group["kind"] == "token" else None
        group["tie_finding"] = tie_finding(group, config, items)
        group["quantized_heads"] = quantized_heads(group, items)
    return {"folder": folder, "rule": rule, "items": items, "across": across, "measure_error": measured.get("error"),
            "onnxruntime": items[0]["info"].onnxruntime if items else None}


def inspect_variants(folder, scratch, limits, proof_past=None, static=False, settings=DEFAULTS):
    """[{"dtype", "result"}]: each dtype variant of the transformers.js folder `folder` (layout.variants) inspected
    as the folder a client loads (inspect_folder), one after another, each in a scratch folder of its own: a
    client opens one variant, so each variant's sessions are measured together and never with another's."""
    found = []
    for i, (dtype, _) in enumerate(variants(folder) or []):
        where = os.path.join(scratch, f"variant{i}")
        if not static:
            os.mkdir(where)
        limits.progress(f"{dtype}: inspecting its files")
        found.append({"dtype": dtype, "result": inspect_folder(folder, where, limits, proof_past, dtype, static,
                                                               settings)})
    return found
