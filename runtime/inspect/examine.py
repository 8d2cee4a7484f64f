"""One model file examined: everything inspect's report shows of it (tables, heads, pairs, runtime copies, what a
session holds), as one found.Findings: the --json output plus what --retie needs."""
import contextlib
import os

from graphs.storage import data_path
from runtime.model.findings import counting
from runtime.model.findings.counting import DEFAULTS
from runtime.model.findings.copies import copy_sizes, runtime_copies
from runtime.model.findings.relations import relate, table_shaped
from runtime.model.findings.vocabulary import copy_key, vocabulary
from runtime.model.found import Findings, static_findings
from runtime.model.graph.entries import HeadEntry
from runtime.model.graph.walk import find_tables_and_heads, lookup_rows
from runtime.model.read import paths
from runtime.model.read.model import load
from runtime.model.read.text import InspectError
from runtime import feeds
from runtime.inspect.sandbox import folding, isolated, jobs, memory, originals
from runtime.resident import OWNED_MOST, prepacked_copies, unscoped


def inspect_model(path, folder, limits=None, proof_past=None, static=False, measure=DEFAULTS, root=None):
    """Everything the report shows, as one found.Findings (the --json output plus what --retie needs).

    `folder` is a scratch folder for onnxruntime's optimized model; `limits` bound the isolated child;
    `proof_past` the past length of the decoder feeds it runs the model on (default: feeds.plan's); `static`:
    from the files alone, onnxruntime never started (no runtime copies, nothing counted in memory); `measure`: the
    counting.SETTINGS measured (each setting's copies are counted whether measured or not); () measures none (a
    folder measures its files together); `root`:
    where the file must really lie when it is opened (a folder's: read.paths.root_of), default anywhere."""
    if static:
        return _from_files(path, limits or isolated.Limits(), proof_past, root)
    return start(path, folder, limits, proof_past, measure, root).finish()


def start(path, folder, limits=None, proof_past=None, measure=DEFAULTS, root=None, child=True):
    """inspect_model begun (an Examination): the file read, the optimizing child started, the tables related.
    `child`: False reads the file alone (a folder's files, measured together in one child that also writes their
    layouts: examine_folder); relate() and begin() or finish(answer) then follow."""
    return Examination(path, folder, limits, proof_past, measure, root, child)


def _read(path, limits, root):
    """The Model at `path`, read where read.paths.model_path says, inside `root` (or its own)."""
    limits.progress(f"reading and checking {path}")
    path, own = paths.model_path(path)
    return load(path, root=root or own)


class Examination:
    """inspect_model in two halves: the files read and related here while onnxruntime opens the model in a child;
    finish() measures (the settings in `measure`), waits for the child and gives inspect_model's Findings. Several
    files started before any finishes build their optimized models side by side.

    Where the model is measured, one child measures the session under the defaults, opened as its user opens it,
    and writes the optimized model's layout (optimized.data_thrown_away): a model with little inline is measured in the
    session that writes it as it opens (one load for both); one that holds its large tensors inline (a model file
    under 2 GB) is measured first and let go, and a second session, from its shell (each large tensor read where it
    lies in the file), writes the layout (work.measure). Writing holds a copy of what onnxruntime keeps in its own
    memory (resident.owned_bytes: inline or folded tensors); where that is more than resident.OWNED_MOST the
    figures would show it, and a fresh child measures the defaults again."""

    def __init__(self, path, folder, limits=None, proof_past=None, measure=DEFAULTS, root=None, child=True):
        self.limits = limits = limits or isolated.Limits()
        self.model = model = _read(path, limits, root)
        self.shape = feeds.plan(model.proto, model.path, proof_past)
        self.folder = folder
        self.tables, self.heads = find_tables_and_heads(model)
        # what a copy onnxruntime makes may hold: a table's values (a folder's other files' tables may be any head's)
        self.watched = self.tables + (table_shaped(self.tables, self.heads) if measure else self.heads)
        self.rows = lookup_rows(self.tables)
        self.settings = list(measure) if self.tables else []  # nothing to measure without a table
        # one child measures the defaults and writes the layout (one session, or, where the model holds its tensors
        # inline, a second one from its shell once the first is measured: work.measure)
        self.merged = "defaults" in self.settings and not memory.too_large(model.file_bytes)
        self.out = os.path.join(folder, "optimized.onnx")
        self.sizes = copy_sizes(model, [e.initializer for e in self.watched])
        self.job = jobs.optimize(jobs.user_model(model.checked), self.out, folder, self.sizes)
        self.first, self.pairs = None, None
        if child:
            self.begin()
            self.relate()

    def watch(self, tables):
        """Watch for copies only this file's tables and its heads shaped as one of `tables` (every file's of a
        folder, once all are read): no other weight can hold a table's values."""
        self.watched = self.tables + table_shaped(tables, self.heads)
        self.sizes = copy_sizes(self.model, [e.initializer for e in self.watched])
        self.job = jobs.optimize(jobs.user_model(self.model.checked), self.out, self.folder, self.sizes)

    def part(self):
        """This file as a part of a folder's measure_together job, its session writing its layout at self.out."""
        return self._proving(jobs.part(jobs.user_model(self.model.checked), self.rows, self.shape, self.out,
                                       self.sizes))

    def _proving(self, job):
        """`job` (this file's measuring job or part) where no --retie will prove it (limits.proving), or where the
        hidden vectors its heads shaped as a table read cannot be shown without changing what onnxruntime makes of
        the graph (originals.shown_ahead); else jobs.proving's: those shown, where a session of its own writes the
        layout, and the proof's feeds run there (sandbox.originals)."""
        heads = [h for h in self.watched if isinstance(h, HeadEntry) and h.graph == "main"]
        show = originals.shown_ahead(self.model.proto, heads) if self.limits.proving and heads else None
        return job if show is None else jobs.proving(job, show, os.path.join(self.folder, "originals.npz"))

    def begin(self):
        """Start the first child: measure the defaults and write the layout where self.merged, else the layout."""
        model, limits = self.model, self.limits
        if self.merged:
            self.first = isolated.start(
                self._proving(jobs.measure(jobs.user_model(model.checked), self.folder, self.rows, self.shape,
                                           layout=self.out, sizes=self.sizes)),
                "running it once (defaults), writing its optimized model's layout", limits, model.file_bytes)
        else:
            self.first = isolated.start(self.job, "building its optimized model", limits, model.file_bytes)

    def relate(self):
        """Relate the tables and heads (while a child loads the model); the child stopped if that fails."""
        try:
            self.limits.progress(f"relating {len(self.tables)} table(s) and {len(self.heads)} head(s): a digest of "
                                 "each")
            self.pairs = relate(self.model, self.tables, self.heads)
        except BaseException:
            self.stop()
            raise

    def stop(self):
        """End the first child now if it still runs."""
        if self.first is not None:
            self.first.stop()

    def finish(self, answer=None):
        """inspect_model's Findings (the child stopped on the way out, whatever happens). `answer`: what a folder's
        measure_together child said of this file's layout (its "layouts" entry): no child of its own is waited for,
        and nothing is measured here."""
        try:
            optimized, measured = self._optimized_and_measured() if answer is None else (self._data(answer), {})
        finally:
            self.stop()
        return found(self, optimized, measured)

    def _data(self, answer):
        """`answer` (an optimize child's, or a measuring child's that wrote the layout), or, where the layout shows a
        tensor of a table's size onnxruntime made, the optimized model built again with its data, whose values are
        then compared."""
        if not answer.data or answer.written:
            return answer
        os.remove(self.out)
        self.first = isolated.start(jobs.optimize(jobs.user_model(self.model.checked), self.out, self.folder),
                                    "building its optimized model", self.limits, self.model.file_bytes)
        return optimized_version(self.first, self.model.path)

    def _measured(self, settings):
        """memory.measure's figures under `settings`, side by side where the machine has the cores and memory."""
        model = self.model
        if not settings:
            return {}
        part = jobs.part(jobs.user_model(model.checked), self.rows, self.shape)
        return memory.measure(part, self.folder, self.limits, model.file_bytes,
                              isolated.side_by_side(model.file_bytes, len(settings)), settings)

    def _optimized_and_measured(self):
        """(optimized_version's answer, memory.measure's figures or {}). Where the first child's run fails (a model
        onnxruntime refuses to run on the feeds), its optimized model is built alone and its settings measured,
        so that each failure is reported as it would be in turn: the optimized model's first."""
        model, limits = self.model, self.limits
        if not self.merged:  # the measurements beside the optimizing child where the machine allows, else after it
            if not self.settings:
                return optimized_version(self.first, model.path), {}
            if not isolated.side_by_side(model.file_bytes, 1 + len(self.settings)):
                return optimized_version(self.first, model.path), self._measured(self.settings)
            try:
                measured = self._measured(self.settings)
            except InspectError:
                optimized_version(self.first, model.path)  # its failure is the one to report, as in turn
                raise
            return optimized_version(self.first, model.path), measured
        try:
            answer = self.first.result()
        except isolated.StepFailed:
            for written in (self.out, data_path(self.out)):  # what the failed child wrote before its run failed
                with contextlib.suppress(FileNotFoundError):
                    os.remove(written)
            self.first = isolated.start(self.job, "building its optimized model", limits, model.file_bytes)
            return optimized_version(self.first, model.path), self._measured(self.settings)
        measured = {}
        again = ["defaults"] if answer.optimized.owned_bytes > OWNED_MOST else []  # writing held what they count
        if not again:
            measured["defaults"] = answer.figures._asdict()
        others = [s for s in self.settings if s != "defaults"]
        return self._data(answer.optimized), {**measured, **self._measured(again + others)}


def optimized_version(optimizing, path):
    """What an optimize child (isolated.start) answers (an answers.Optimized), or InspectError: it cannot load
    `path`."""
    try:
        return optimizing.result()
    except isolated.StepFailed as e:
        raise InspectError(f"{path}: onnxruntime cannot load it: {str(e).split(': ', 1)[-1]}") from None


def found(exam, answer, measured):
    """inspect_model's Findings, from what the parent read (an Examination's model, tables, heads, pairs, rows, shape)
    and what onnxruntime's optimized model (at its job's out, its child's `answer`: optimized_version's) and the
    measurements show. Only the tables and the heads that can hold their values are watched for copies."""
    model, tables, heads, pairs = exam.model, exam.tables, exam.heads, exam.pairs
    optimized_path = exam.out
    optimized = folding.read_optimized(optimized_path, os.path.dirname(optimized_path), answer)
    version = answer.onnxruntime
    unrecorded = answer.unrecorded  # a layout written with prepacking off: the tables' packings probed
    prepacked = prepacked_copies(optimized.proto) + (unrecorded.probed if unrecorded else [])
    watched = list(dict.fromkeys(e.initializer for e in exam.watched))
    copies = runtime_copies(model, optimized, watched, answer.folded)
    paired = {t.initializer for t in tables} | {p.head for p in pairs}
    ours = paired | {copy_key(c) for c in copies if c.get("copy_of") in paired}  # and what is folded from them
    for p in prepacked:
        if p["initializer"] in ours:
            name, graph = unscoped(p["initializer"])  # a body's folded copy, prepacked in its branch
            copies.append({"name": f"{name} prepacked", "bytes": p["bytes"], "shape": None, "copy_of": name,
                           "view": "prepacked", "transposed": False, "kernel": p["kernel"], "node": p["node"],
                           **({"graph": graph} if graph else {})})

    def held(names, table_bytes, other_bytes):
        return counting.in_memory(names, table_bytes, other_bytes, optimized, prepacked, measured)

    return Findings(model, tables, heads, pairs, vocabulary(model, tables, heads, pairs, copies, held, version),
                    shape=exam.shape, runtime_copies=copies, onnxruntime=version,
                    measure_error=measured.get("error"), optimized=optimized, prepacked=prepacked,
                    unrecorded=unrecorded, originals=answer.originals)


def _from_files(path, limits, proof_past, root):
    """inspect_model(static=True): what the files say, in the time it takes to read them."""
    model = _read(path, limits, root)
    return static_findings(model, feeds.plan(model.proto, model.path, proof_past))
