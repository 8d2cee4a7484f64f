"""One model file examined: everything inspect's report shows of it (tables, heads, pairs, runtime copies, what a
session holds), as one dict: the --json output plus what --retie needs."""
import os

from runtime.inspect.findings import counting
from runtime.inspect.findings.relations import copy_key, relate, runtime_copies, vocabulary
from runtime.inspect.graph.walk import find_tables_and_heads, lookup_ids
from runtime.inspect.graph.weights import shared_weights
from runtime.inspect.read import paths
from runtime.inspect.read.model import load
from runtime.inspect.read.text import InspectError
from runtime.inspect.sandbox import feeds, isolated, memory
from runtime.resident import prepacked_copies, unscoped


def inspect_model(path, folder, limits=None, proof_past=None, static=False, measure=True, root=None):
    """Everything the report shows, as one dict (the --json output plus what --retie needs).

    `folder` is a scratch folder for onnxruntime's optimized model; `limits` bound the isolated child;
    `proof_past` the past length of the decoder feeds it runs the model on (default: feeds.plan's); `static`:
    from the files alone, onnxruntime never started (no runtime copies, nothing counted in memory); `measure`:
    False counts the copies a session holds without measuring one (a folder measures its files together); `root`:
    where the file must really lie when it is opened (a folder's: read.paths.root_of), default anywhere."""
    if static:
        return _from_files(path, limits or isolated.Limits(), proof_past, root)
    return start(path, folder, limits, proof_past, measure, root).finish()


def start(path, folder, limits=None, proof_past=None, measure=True, root=None):
    """inspect_model begun (an Examination): the file read, the optimizing child started, the tables related."""
    return Examination(path, folder, limits, proof_past, measure, root)


def _read(path, limits, root):
    """The Model at `path`, read where read.paths.model_path says, inside `root` (or its own)."""
    limits.progress(f"reading and checking {path}")
    path, own = paths.model_path(path)
    return load(path, root=root or own)


class Examination:
    """inspect_model in two halves: the files read and related here and onnxruntime's optimized model started in
    a child; finish() measures (unless `measure` is False), waits for the child and gives inspect_model's dict.
    Several files started before any finishes build their optimized models side by side."""

    def __init__(self, path, folder, limits=None, proof_past=None, measure=True, root=None):
        self.limits = limits = limits or isolated.Limits()
        self.model = model = _read(path, limits, root)
        self.shape = feeds.plan(model.proto, model.path, proof_past)
        self.folder = folder
        self.job = {"kind": "optimize", "checked": model.checked, "out": os.path.join(folder, "optimized.onnx"),
                    "folder": folder}
        self.optimizing = isolated.start(self.job, "building its optimized model", limits, model.file_bytes)
        try:  # the child builds while this process finds and relates
            self.tables, self.heads = find_tables_and_heads(model)
            limits.progress(f"relating {len(self.tables)} table(s) and {len(self.heads)} head(s): a digest of each")
            self.pairs = relate(model, self.tables, self.heads)
        except BaseException:
            self.optimizing.stop()
            raise
        self.rows = {lookup_ids(t): t["vocab"] for t in self.tables}  # each lookup's ids, and the rows they may name
        self.measure = measure and bool(self.tables)
        self.runs = 1 + (len(counting.SETTINGS) if self.measure else 0)

    def stop(self):
        """End the optimizing child now if it still runs."""
        self.optimizing.stop()

    def finish(self):
        """inspect_model's dict (the child stopped on the way out, whatever happens)."""
        model = self.model
        try:
            version, measured = self._optimized_and_measured()
        finally:
            self.optimizing.stop()
        return found(model, self.tables, self.heads, self.pairs, self.rows, self.shape, self.job["out"], version,
                     measured)

    def _optimized_and_measured(self):
        """(onnxruntime's version, memory.measure's figures or {}): the measurements run beside the optimizing child
        where the machine has the cores and the memory (isolated.side_by_side; each in its own child: a session
        that writes its optimized model holds about one more table, so the one measured writes nothing), else after
        it. A failure is reported as it would be in turn: the optimized model's first."""
        model, limits = self.model, self.limits

        def measured(side_by_side=False):
            return memory.measure({"checked": model.checked}, self.rows, self.shape, self.folder, limits,
                                  model.file_bytes, side_by_side) if self.measure else {}

        if not isolated.side_by_side(model.file_bytes, self.runs):
            return optimized_version(self.optimizing, model.path), measured()
        try:
            figures = measured(side_by_side=True)
        except InspectError:
            optimized_version(self.optimizing, model.path)  # its failure is the one to report, as in turn
            raise
        return optimized_version(self.optimizing, model.path), figures


def optimized_version(optimizing, path):
    """The onnxruntime version an optimize child (isolated.start) reports, or InspectError: it cannot load `path`."""
    try:
        return optimizing.result()["onnxruntime"]
    except isolated.StepFailed as e:
        raise InspectError(f"{path}: onnxruntime cannot load it: {str(e).split(': ', 1)[-1]}") from None


def found(model, tables, heads, pairs, rows, shape, optimized_path, version, measured):
    """inspect_model's dict, from what the parent read and what onnxruntime's optimized model (at `optimized_path`)
    and the measurements show."""
    optimized = load(optimized_path, os.path.dirname(optimized_path))
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

    def held(names, table_bytes, other_bytes):
        return counting.in_memory(names, table_bytes, other_bytes, optimized, prepacked, measured)

    return {"model": model, "tables": tables, "heads": heads, "file_bytes": model.file_bytes,
            "initializers": initializers, "pairs": pairs, "runtime_copies": copies, "rows": rows, "shape": shape,
            "vocabulary": vocabulary(model, tables, heads, pairs, copies, held, version), "onnxruntime": version,
            "measure_error": measured.get("error"),
            "optimized_bytes": sum(t.nbytes for t in optimized.tensors.values()), "optimized": optimized,
            "prepacked": prepacked, "branch_weights": branch_weights(model)}


def _from_files(path, limits, proof_past, root):
    """inspect_model(static=True): what the files say, in the time it takes to read them."""
    model = _read(path, limits, root)
    path = model.path
    tables, heads = find_tables_and_heads(model)
    pairs = relate(model, tables, heads)
    initializers = [{"name": t.name, "dtype": t.type_name, "shape": t.dims, "elements": t.elements,
                     "bytes": t.nbytes} for t in model.tensors.values()]
    held = lambda names, table_bytes, other_bytes: counting.not_counted()
    return {"model": model, "tables": tables, "heads": heads, "file_bytes": model.file_bytes,
            "initializers": initializers, "pairs": pairs, "runtime_copies": None,
            "rows": {lookup_ids(t): t["vocab"] for t in tables}, "shape": feeds.plan(model.proto, path, proof_past),
            "vocabulary": vocabulary(model, tables, heads, pairs, [], held, None), "onnxruntime": None,
            "measure_error": None, "optimized": None, "prepacked": [], "branch_weights": branch_weights(model)}


def branch_weights(model):
    """[{name, bytes, graphs}]: the matmul weights two or more graphs of `model` read (graph.weights.shared_weights),
    each of which onnxruntime's defaults prepack once per graph."""
    return [{"name": name, "bytes": model.tensors[name].nbytes, "graphs": graphs}
            for name, graphs in sorted(shared_weights(model).items())]
