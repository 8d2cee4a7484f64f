"""What inspect knows of one model file (Findings): its tables and heads, how they relate, one vocabulary entry per
table, and, where onnxruntime opened it, the copies its session makes and what it holds. static_findings gives what
the files alone show (inspect --static reports it; compare --model reads its token table from it)."""
import functools
from dataclasses import dataclass, field

from runtime.model.findings import counting
from runtime.model.findings.relations import relate
from runtime.model.findings.vocabulary import vocabulary
from runtime.model.graph.walk import find_tables_and_heads, lookup_rows
from runtime.model.graph.weights import shared_weights


@dataclass(eq=False)
class Findings:
    """One model file examined: each fact inspect's report, --json, --check and --retie read, in one place.

    model: the checked Model (read.model.load); tables, heads: its [TableEntry] and [HeadEntry] (graph.entries);
    pairs: [relations.Pair], each table with each head of its shape; vocabulary: one entry per table
    (findings.vocabulary: its kind, sizes, copies and, where measured, what a session holds of it);
    shape: the decoder feeds' plan (runtime.feeds.plan), None where nothing will run the model.
    From onnxruntime (None, or empty, under --static): runtime_copies, the tensors its optimized model adds that
    can hold a table's values (findings.copies, each a dict, prepacked ones included); onnxruntime: its version;
    measure_error: why a session could not be measured, or None; optimized: its optimized model (a Model, its
    layout); prepacked: [{initializer, kernel, node, bytes}] what its kernels prepacked (resident.prepacked_copies,
    and the probed packings); unrecorded: where the layout was written with prepacking off, why and the packings
    probed instead (sandbox.answers.Unrecorded), else None;
    originals: the original's outputs on the proof's feeds, saved ahead by the measuring child
    (sandbox.originals.save), or None.
    Judged after (inspect.analysis sets each once): prefill, [findings.prefill.all_positions' entries]; verdict,
    [verdict.file_verdict's entries] (None until judged, and for a folder's file: the folder's verdict is its own)."""
    model: object
    tables: list
    heads: list
    pairs: list
    vocabulary: list
    shape: dict | None = None
    runtime_copies: list | None = None
    onnxruntime: str | None = None
    measure_error: str | None = None
    optimized: object = None
    prepacked: list = field(default_factory=list)
    unrecorded: tuple | None = None
    originals: dict | None = None
    prefill: list = field(default_factory=list)
    verdict: list | None = None

    @property
    def file_bytes(self):
        """The bytes of the model's files: its protobuf and every external data file it reads."""
        return self.model.file_bytes

    @property
    def rows(self):
        """{ids input: vocab}: each lookup's ids, and the rows they may name (the decoder feeds' bound)."""
        return lookup_rows(self.tables)

    @functools.cached_property
    def initializers(self):
        """[{name, dtype, shape, elements, bytes}]: every initializer of the main graph, as --json lists them."""
        return [{"name": t.name, "dtype": t.type_name, "shape": t.dims, "elements": t.elements, "bytes": t.nbytes}
                for t in self.model.tensors.values()]

    @functools.cached_property
    def branch_weights(self):
        """[{name, bytes, graphs}]: the matmul weights two or more graphs read (graph.weights.shared_weights), each
        of which onnxruntime's defaults prepack once per graph."""
        return [{"name": name, "bytes": self.model.tensors[name].nbytes, "graphs": graphs}
                for name, graphs in sorted(shared_weights(self.model).items())]


def _not_counted(names, table_bytes, other_bytes):
    return counting.not_counted()


def static_findings(model, shape=None):
    """The Findings of a checked Model (read.model.load) from its files alone: nothing counted in memory, no
    onnxruntime; `shape` the decoder feeds' plan, where one is wanted."""
    tables, heads = find_tables_and_heads(model)
    pairs = relate(model, tables, heads)
    return Findings(model, tables, heads, pairs, vocabulary(model, tables, heads, pairs, [], _not_counted, None),
                    shape=shape)
