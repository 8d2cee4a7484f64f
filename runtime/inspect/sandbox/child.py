"""The isolated child's entry point: `python -m runtime.inspect.sandbox.child JOB.json` runs one step on an untrusted model
(build its optimized model, measure a session, prove a retie) and writes its answer to the job's `result` path.
`python -m runtime.inspect.sandbox.child - SCRATCH` (how runtime.inspect.sandbox.isolated starts it) first imports what the
jobs use, then waits for one JSON line on stdin: the job's path, the rlimits to set and its TMPDIR; it sets them
before it reads the job, so a child started ahead of its job (isolated.prestart) runs it as confined as one
started for it. End of input before a line: nothing to do.

An entry module of its own, apart from runtime.inspect.sandbox.isolated (which starts it): a module run as `__main__` is
a second copy of itself, so an exception class raised by code that imported the library (`Changed`, from proof)
would not be the one `except` names here. runtime.inspect's package imports nothing, so this starts lean.
"""
import json
import os
import sys

from runtime.model.read.checked import Changed
from runtime.inspect.sandbox import answers, work
from runtime.inspect.sandbox.isolated import OUT_OF_MEMORY


def _first_line(e):
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


_JOBS = {"optimize": work.optimize, "measure": work.measure, "measure_together": work.measure_together,
         "prove": work.prove, "prefill": work.prefill, "head_lookup": work.head_lookup,
         "quality": work.quality}


def main(path):
    with open(path) as f:
        job = json.load(f)
    try:
        answer = answers.wire(_JOBS[job["kind"]](job))  # an answers type, as a JSON object
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


AHEAD = ("numpy", "onnx", "onnxruntime", "runtime.resident", "runtime.runner", "runtime.feeds",
         "runtime.inspect.sandbox.proof", "runtime.inspect.sandbox.timing")  # what the jobs import


def _ordered():
    """Import what the jobs use, then run the job the order on stdin names, under its limits (see above)."""
    import importlib
    import resource
    import tempfile

    for name in AHEAD:  # imported before the order comes: the time a child takes to start
        importlib.import_module(name)
    line = sys.stdin.readline()
    if not line:
        return 0
    order = json.loads(line)
    for kind, limit in order["limits"]:
        resource.setrlimit(kind, (limit, limit))
    os.environ["TMPDIR"], tempfile.tempdir = order["tmpdir"], None
    return main(order["job"])


if __name__ == "__main__":
    sys.exit(_ordered() if sys.argv[1:2] == ["-"] else main(sys.argv[1]))
