"""One model file examined: everything inspect's report shows of it (tables, heads, pairs, runtime copies, what a
session holds), as one dict: the --json output plus what --retie needs."""
import os

from runtime.inspect import feeds, isolated, memory
from runtime.inspect.reading import InspectError, load
from runtime.inspect.relations import copy_key, relate, runtime_copies, vocabulary
from runtime.inspect.walk import find_tables_and_heads, lookup_ids
from runtime.resident import prepacked_copies, unscoped


def inspect_model(path, folder, limits=None, proof_past=None, static=False):
    """Everything the report shows, as one dict (the --json output plus what --retie needs).

    `folder` is a scratch folder for onnxruntime's optimized model; `limits` bound the isolated child;
    `proof_past` the past length of the decoder feeds it runs the model on (default: feeds.plan's); `static`:
    from the files alone, onnxruntime never started (no runtime copies, nothing counted in memory)."""
    if static:
        return _from_files(path, limits or isolated.Limits(), proof_past)
    limits = limits or isolated.Limits()
    limits.progress(f"reading and checking {path}")
    path = os.path.realpath(path)  # what the child opens is what was checked: `link/..` as the OS resolves it
    model = load(path)
    shape = feeds.plan(model.proto, path, proof_past)
    tables, heads = find_tables_and_heads(model)
    limits.progress(f"relating {len(tables)} table(s) and {len(heads)} head(s): a digest of each")
    pairs = relate(model, tables, heads)
    optimized_path = os.path.join(folder, "optimized.onnx")
    job = {"kind": "optimize", "checked": model.checked, "out": optimized_path, "folder": folder}
    try:
        version = isolated.call(job, "building its optimized model", limits, model.file_bytes)["onnxruntime"]
    except isolated.StepFailed as e:
        raise InspectError(f"{path}: onnxruntime cannot load it: {str(e).split(': ', 1)[-1]}") from None
    optimized = load(optimized_path, folder)
    prepacked = prepacked_copies(optimized.proto)
    watched = list(dict.fromkeys([t["initializer"] for t in tables] + [h["initializer"] for h in heads]))
    initializers = [{"name": t.name, "dtype": t.type_name, "shape": t.dims, "elements": t.elements,
                     "bytes": t.nbytes} for t in model.tensors.values()]
    copies = runtime_copies(model, optimized, watched)
    paired = {t["initializer"] for t in tables} | {p["head"] for p in pairs}
    ours = paired | {copy_key(c) for c in copies if c.get("copy_of") in paired}  # and what is folded from them
    for p in prepacked:
        if p["initializer"] in ours:
            name, graph = unscoped(p["initializer"])  # a body's folded copy, prepacked in its branch
            copies.append({"name": f"{name} prepacked", "bytes": p["bytes"], "shape": None, "copy_of": name,
                           "view": "prepacked", "transposed": False, "kernel": p["kernel"], "node": p["node"],
                           **({"graph": graph} if graph else {})})
    rows = {lookup_ids(t): t["vocab"] for t in tables}  # each lookup's ids, and the rows they may name
    measured = memory.measure({"checked": model.checked}, rows, shape, folder, limits,
                              model.file_bytes) if tables else {}

    def held(names, table_bytes, other_bytes):
        return memory.in_memory(names, table_bytes, other_bytes, optimized, prepacked, measured)

    return {"model": model, "tables": tables, "heads": heads, "file_bytes": model.file_bytes,
            "initializers": initializers, "pairs": pairs, "runtime_copies": copies, "rows": rows, "shape": shape,
            "vocabulary": vocabulary(model, tables, heads, pairs, copies, held, version), "onnxruntime": version,
            "measure_error": measured.get("error"),
            "optimized_bytes": sum(t.nbytes for t in optimized.tensors.values()), "optimized": optimized,
            "prepacked": prepacked}


def _from_files(path, limits, proof_past):
    """inspect_model(static=True): what the files say, in the time it takes to read them."""
    limits.progress(f"reading and checking {path}")
    path = os.path.realpath(path)
    model = load(path)
    tables, heads = find_tables_and_heads(model)
    pairs = relate(model, tables, heads)
    initializers = [{"name": t.name, "dtype": t.type_name, "shape": t.dims, "elements": t.elements,
                     "bytes": t.nbytes} for t in model.tensors.values()]
    held = lambda names, table_bytes, other_bytes: memory.not_counted()
    return {"model": model, "tables": tables, "heads": heads, "file_bytes": model.file_bytes,
            "initializers": initializers, "pairs": pairs, "runtime_copies": None,
            "rows": {lookup_ids(t): t["vocab"] for t in tables}, "shape": feeds.plan(model.proto, path, proof_past),
            "vocabulary": vocabulary(model, tables, heads, pairs, [], held, None), "onnxruntime": None,
            "measure_error": None, "optimized": None, "prepacked": []}
