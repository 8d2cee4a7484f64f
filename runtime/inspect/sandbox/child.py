"""The isolated child's entry point: `python -m runtime.inspect.sandbox.child JOB.json` runs one step on an untrusted model
(build its optimized model, measure a session, prove a retie) and writes its answer to the job's `result` path.

An entry module of its own, apart from runtime.inspect.sandbox.isolated (which starts it): a module run as `__main__` is
a second copy of itself, so an exception class raised by code that imported the library (`Changed`, from proof)
would not be the one `except` names here. runtime.inspect's package imports nothing, so this starts lean.
"""
import json
import sys

from runtime.inspect.read.checked import Changed, source
from runtime.inspect.sandbox.isolated import OUT_OF_MEMORY


def _first_line(e):
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _model(job):
    """(the model's bytes or path, the folder of its data or None): the bytes that were checked when the job
    carries `checked` (the user's model), else the path (a file this tool wrote in its scratch folder)."""
    return source(job["checked"]) if "checked" in job else (job["model"], None)


def _optimize(job):
    from runtime.runner import write_optimized_model
    model, folder = _model(job)
    write_optimized_model(model, job["out"], prepacked=True, data_folder=folder)  # the defaults' prepacks recorded
    import onnxruntime
    return {"onnxruntime": onnxruntime.__version__}  # whose folding and prepacking the report describes


def _measure(job):
    """What a session adds after one run of the proof's decoder feeds, in this fresh process."""
    import onnx

    from runtime.inspect.sandbox.feeds import shaped_feeds
    from runtime.resident import session_growth
    model, folder = _model(job)
    proto = onnx.load_model_from_string(model) if folder else onnx.load(model, load_external_data=False)
    feeds = shaped_feeds(proto, job["rows"], job["shape"], job["shape"]["lengths"][0])
    del proto
    return session_growth(model, feeds, job["prepacking"], data_folder=folder)


def _measure_together(job):
    """What sessions on every file of a folder add when one process holds them all (Pss), after one run each."""
    import onnx

    from runtime.inspect.sandbox.feeds import shaped_feeds
    from runtime.resident import sessions_growth
    models = []
    for part in job["files"]:
        model, folder = _model(part)
        proto = onnx.load_model_from_string(model) if folder else onnx.load(model, load_external_data=False)
        models.append((model, folder, shaped_feeds(proto, part["rows"], part["shape"], part["shape"]["lengths"][0])))
        del proto
    return sessions_growth(models, job["prepacking"])


def _prove(job):
    from runtime.inspect.sandbox.proof import OriginalFails, prove
    try:
        return {"failures": prove(job)}
    except OriginalFails as e:
        return {"failures": [], "original": str(e)}


_JOBS = {"optimize": _optimize, "measure": _measure, "measure_together": _measure_together, "prove": _prove}


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
