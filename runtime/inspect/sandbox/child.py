"""The isolated child's entry point: `python -m runtime.inspect.sandbox.child JOB.json` runs one step on an untrusted model
(build its optimized model, measure a session, prove a retie) and writes its answer to the job's `result` path.

An entry module of its own, apart from runtime.inspect.sandbox.isolated (which starts it): a module run as `__main__` is
a second copy of itself, so an exception class raised by code that imported the library (`Changed`, from proof)
would not be the one `except` names here. runtime.inspect's package imports nothing, so this starts lean.
"""
import json
import os
import sys

from runtime.model.read.checked import Changed, source
from runtime.inspect.sandbox.isolated import OUT_OF_MEMORY


def _first_line(e):
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _model(job):
    """(the model's bytes or path, the folder of its data or None): the bytes that were checked when the job
    carries `checked` (the user's model), else the path (a file this tool wrote in its scratch folder)."""
    return source(job["checked"]) if "checked" in job else (job["model"], None)


def _optimize(job):
    """onnxruntime's optimized model written to job["out"], its prepacked copies recorded. With job["sizes"] (the
    element counts of the tensors whose copies are looked for), its layout first, without data; the data only
    when the optimizer made a tensor of one of those sizes, whose values must then be compared."""
    import onnxruntime

    from runtime.runner import write_optimized_layout, write_optimized_model
    model, folder = _model(job)
    answer = {"onnxruntime": onnxruntime.__version__, "data": True}  # whose folding and prepacking is described
    if job.get("sizes") is not None:
        write_optimized_layout(model, job["out"], data_folder=folder)
        if not _copies_to_compare(_proto(model, folder), _proto(job["out"]), job["sizes"]):
            return {**answer, "data": False}
        os.remove(job["out"])
    write_optimized_model(model, job["out"], prepacked=True, data_folder=folder)  # the defaults' prepacks recorded
    return answer


def _proto(model, folder=None):
    """The ModelProto of `model`: serialized bytes when `folder` (where its data lies) is given, else a path; its
    tensor data not loaded."""
    import onnx
    return onnx.load_model_from_string(model) if folder else onnx.load(model, load_external_data=False)


def _copies_to_compare(original, layout, sizes):
    """Whether the optimized model `layout` holds a tensor onnxruntime made (resident.made) of one of `sizes`
    elements (None: any): a possible copy of a table, whose values the layout alone does not show."""
    import math

    from runtime.resident import made
    return sizes is None or any(math.prod(t.dims) in set(sizes) for t in made(original, layout))


def _measure(job):
    """What a session adds after one run of the proof's decoder feeds, in this fresh process. With job["layout"],
    the session also writes its optimized model's layout there (one load for both), and the answer says what the
    optimize job's would ("onnxruntime", "data") and how many bytes writing it held ("owned_bytes": the figures
    stand only where that is small)."""
    import onnxruntime

    from runtime.inspect.sandbox.feeds import first_feeds
    from runtime.resident import owned_bytes, session_growth
    model, folder = _model(job)
    proto = _proto(model, folder)
    feeds = first_feeds(proto, job["rows"], job["shape"])
    if not job.get("layout"):
        del proto
        return session_growth(model, feeds, job["prepacking"], data_folder=folder)
    figures = session_growth(model, feeds, job["prepacking"], data_folder=folder, layout=job["layout"])
    layout = _proto(job["layout"])
    return {**figures, "onnxruntime": onnxruntime.__version__, "owned_bytes": owned_bytes(proto, layout),
            "data": _copies_to_compare(proto, layout, job.get("sizes"))}


def _measure_together(job):
    """What sessions on every file of a folder add when one process holds them all (Pss), after one run each."""
    from runtime.inspect.sandbox.feeds import first_feeds
    from runtime.resident import sessions_growth
    models = []
    for part in job["files"]:
        model, folder = _model(part)
        proto = _proto(model, folder)
        models.append((model, folder, first_feeds(proto, part["rows"], part["shape"])))
        del proto
    return sessions_growth(models, job["prepacking"])


def _prove(job):
    """The proof's failures and, where the retied model's session wrote its optimized model's layout, whether that
    layout holds a tensor of job["sizes"] elements it did not (its data must then be written to be compared), the
    session's figures where job["measure"], the bytes writing the layout held (resident.owned_bytes), and where the
    weights are read in place how far the other outputs lie from the original's under the defaults (proof._drift)."""
    from runtime.inspect.sandbox.proof import OriginalFails, prove
    from runtime.resident import owned_bytes
    try:
        proven = prove(job)
    except OriginalFails as e:
        return {"failures": [], "original": str(e)}
    answer = {"failures": proven.failures, "kept": proven.kept, "drift": proven.drift, "heads": proven.heads}
    if not job.get("layout"):
        return answer
    retied, layout = _proto(job["after"]), _proto(job["layout"])
    return {**answer, "data": _copies_to_compare(retied, layout, job.get("sizes")), "measured": proven.figures,
            "owned_bytes": owned_bytes(retied, layout)}


def _prefill(job):
    """One profiled run of the model at job["tokens"] prompt tokens (runtime.inspect.sandbox.timing)."""
    from runtime.inspect.sandbox import timing
    model, folder = _model(job)
    return timing.run(job, model, folder, _proto(model, folder))


_JOBS = {"optimize": _optimize, "measure": _measure, "measure_together": _measure_together, "prove": _prove,
         "prefill": _prefill}


def main(path):
    with open(path) as f:
        job = json.load(f)
    try:
        answer = _JOBS[job["kind"]](job)
    except MemoryError:
        return OUT_OF_MEMORY
    except Changed as e:
        answer = {"changed": str(e)}
    except Exception as e:  # noqa: BLE001 - onnx or onnxruntime refusing the model: the parent reports it
        if "bad_alloc" in str(e) or "Failed to allocate" in str(e):
            return OUT_OF_MEMORY
        answer = {"error": _first_line(e)}
    with open(job["result"], "w") as f:
        json.dump(answer, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
