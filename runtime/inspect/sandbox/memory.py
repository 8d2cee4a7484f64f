"""What a user's process holds: copies of each table under onnxruntime's default SessionOptions (prepacked
ones included, which no initializer of the optimized model shows) and with prepacking off, counted from the
optimized model and measured in the isolated child after one run."""
from runtime.model.findings.counting import SETTINGS
from runtime.inspect.sandbox import isolated, jobs


def measure(model, folder, limits, model_bytes, side_by_side=False, settings=SETTINGS):
    """`model`: a jobs.part (of the user's model or one this tool wrote), as measure_together's parts; `settings`:
    those of SETTINGS to measure (all by default).

    {setting: answers.Figures' fields as a dict, or None, "error": why} for each of SETTINGS, each in a fresh
    isolated child, on the feeds `shape` (runtime.feeds.plan) describes; `side_by_side`: the
    children run at once (each measures its own resident set, which another process mapping the same file does not
    change). None where onnxruntime refuses to run the model on the proof's feeds; a crash or time-out is an
    InspectError, like every isolated step."""
    why = too_large(model_bytes)
    if why:
        return {**{setting: None for setting in settings}, "error": why}
    measured, running = {}, {}
    source = jobs.source_of(model)
    try:
        for setting in settings:
            job = jobs.measure(source, folder, model["rows"], model["shape"], SETTINGS[setting])
            running[setting] = isolated.start(job, f"running it once ({setting})", limits, model_bytes)
            if not side_by_side:
                _collect(measured, setting, running.pop(setting))
        for setting, child in running.items():
            _collect(measured, setting, child)
    finally:
        for child in running.values():
            child.stop()
    return measured


def too_large(model_bytes):
    """Why a session of a model of `model_bytes` is not opened to be measured, or None: the memory available now
    (MemAvailable) must hold one session at its peak, about the model's bytes and a quarter more (its prepacked
    copies made while the originals are still mapped), and half a GiB of onnxruntime's own. A measurement is not
    worth the machine's swap or the OOM killer; the copies are still counted from the optimized model."""
    available = isolated.available_memory()
    need = model_bytes * 5 // 4 + isolated.GiB // 2
    if available and available < need:
        return (f"a session of this model needs about {need / isolated.GiB:.1f} GiB, {available / isolated.GiB:.1f} "
                "GiB is available now")
    return None


def _collect(measured, setting, child):
    try:
        measured[setting] = child.result().figures._asdict()
    except isolated.StepFailed as e:
        measured[setting], measured["error"] = None, str(e).split(": ", 1)[-1]


def measure_together(parts, folder, limits, model_bytes, settings=tuple(SETTINGS)):
    """measure() for a folder: `parts` [jobs.part] one per file, all sessions held in one child
    (what the client's process holds), Pss so that pages two sessions map count once; `settings` as measure's."""
    why = too_large(model_bytes)
    if why:
        return {**{setting: None for setting in settings}, "error": why}
    measured = {}
    for setting in settings:
        job = jobs.measure_together(parts, folder, SETTINGS[setting])
        _collect(measured, setting, isolated.start(job, f"running every file once in one process ({setting})",
                                                   limits, model_bytes))  # one after the other: Pss is shared
    return measured
