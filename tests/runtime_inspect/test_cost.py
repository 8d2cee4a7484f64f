"""What inspect costs on a many-layer export (issue 47): only a weight that can hold a table's values (one of a
table's vocab x width) is read and related, a layer's weights never; a default run measures the defaults only
(prepacking off under --verbose, which alone shows it); findings stay linear in the heads and outputs (one walk
of the graph for every head's scored output). These tests time nothing: they count reads, children and walks."""
import collections
import os

import onnx
import pytest

from runtime.inspect.examine import inspect_model
from runtime.inspect.examine_folder import inspect_folder
from runtime.inspect.sandbox import isolated
from runtime.model.findings.counting import measured_settings
from runtime.model.read import model as read_model
from tests.helpers import layered, many_tables, tied

LAYERS = 12


@pytest.fixture
def reads(monkeypatch):
    """The initializers whose values or bytes the parent reads: {name: how many times}."""
    counted = collections.Counter()
    for method in ("values", "raw"):
        original = getattr(read_model.Tensor, method)

        def counting(self, _original=original):
            counted[self.name] += 1
            return _original(self)
        monkeypatch.setattr(read_model.Tensor, method, counting)
    return counted


def _layer_reads(reads):
    return {name: n for name, n in reads.items() if name.startswith("layer")}


def test_layered_folder_reads_no_layer_weight(tmp_path, reads):
    folder = tmp_path / "split"  # two files holding the same layers, as a split decoder pair does
    folder.mkdir()
    for name in ("a.onnx", "b.onnx"):
        onnx.save(layered(LAYERS), str(folder / name))
    found = inspect_folder(str(folder), None, isolated.Limits(), static=True)
    pairs = [(p["a"]["file"], p["a"]["name"], p["b"]["file"], p["b"]["name"], p["relation"])
             for p in found["across"]["pairs"]]
    assert pairs == [("a.onnx", "embedding", "b.onnx", "embedding", "duplicate"),
                     ("a.onnx", "embedding", "b.onnx", "lm_head", "transposed_duplicate")]
    assert [(p.table, p.head, p.relation) for it in found["items"] for p in it["info"].pairs] \
        == [("embedding", "lm_head", "transposed_duplicate")] * 2
    assert reads["embedding"] and reads["lm_head"]  # what can hold the table is read
    assert _layer_reads(reads) == {}


def test_layered_file_reads_no_layer_weight(tmp_path, reads):
    path = str(tmp_path / "m.onnx")  # onnxruntime folds each query weight's Transpose into a copy of it
    onnx.save(layered(LAYERS), path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_model(path, str(scratch))
    assert [(p.table, p.head, p.relation) for p in found.pairs] \
        == [("embedding", "lm_head", "transposed_duplicate")]
    assert len([c for c in found.runtime_copies if c["shape"] == [16, 16]]) == LAYERS  # the folded copies
    assert _layer_reads(reads) == {}


@pytest.fixture
def children(monkeypatch):
    """Each isolated child the parent starts, as (kind, prepacking)."""
    started, start = [], isolated.start

    def recording(job, *args, **kwargs):
        started.append((job["kind"], job.get("prepacking")))
        return start(job, *args, **kwargs)
    monkeypatch.setattr(isolated, "start", recording)
    return started


def test_tied_default_run_measures_the_defaults_only(tmp_path, children):
    path = tied(str(tmp_path / "m.onnx"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    entry = inspect_model(path, str(scratch)).vocabulary[0]["in_memory"]
    assert (False not in [prepacking for _, prepacking in children]), children  # no child with prepacking off
    assert entry["defaults"]["resident_bytes"] is not None
    off = entry["no_prepacking"]  # the key kept: its copies counted from the optimized model, nothing measured
    assert off["copies"] == 1 and [off[k] for k in ("resident_bytes", "anonymous_bytes", "file_bytes", "peak_bytes",
                                                    "times_table")] == [None] * 5


def test_tied_verbose_run_measures_prepacking_off_too(tmp_path, children):
    path = tied(str(tmp_path / "m.onnx"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    entry = inspect_model(path, str(scratch), measure=measured_settings(verbose=True)).vocabulary[0]["in_memory"]
    assert ("measure", False) in children
    assert entry["no_prepacking"]["copies"] == 1 and entry["no_prepacking"]["resident_bytes"] is not None


class _CountedOutputs:
    """A scope's GraphProto whose `output` list counts the times it is read: one pass over the outputs a walk."""

    def __init__(self, graph, passes):
        self._graph, self._passes = graph, passes

    def __getattr__(self, name):
        if name == "output":
            self._passes.append(1)
        return getattr(self._graph, name)


def _walks(tmp_path, count, monkeypatch):
    """How many passes over the graph's outputs finding the tables and heads of many_tables(count) makes."""
    from runtime.model.graph import walk
    path = str(tmp_path / f"many{count}.onnx")
    onnx.save(many_tables(count), path)
    passes, scopes = [], walk.scopes
    monkeypatch.setattr(walk, "scopes", lambda graph: [(p, _CountedOutputs(g, passes), *rest)
                                                       for p, g, *rest in scopes(graph)])
    tables, heads = walk.find_tables_and_heads(read_model.load(path))
    assert (len(tables), len(heads)) == (count, count)
    assert all(h.scores == f"l{h.initializer[1:]}" for h in heads)  # each head's product: its own output
    return len(passes)


def test_many_tables_heads_scored_in_one_walk(tmp_path, monkeypatch):
    assert _walks(tmp_path, 5, monkeypatch) == _walks(tmp_path, 60, monkeypatch) == 1


def test_many_tables_verdict_looks_at_each_pair_once(tmp_path, monkeypatch):
    from runtime.inspect import verdict
    path = str(tmp_path / "many.onnx")
    onnx.save(many_tables(30), path)
    info = inspect_model(path, None, static=True)
    looked, stored_copies = [], verdict.stored_copies
    monkeypatch.setattr(verdict, "stored_copies", lambda pairs, table: looked.append(len(pairs)) or
                        stored_copies(pairs, table))
    assert verdict.file_verdict(info) == []  # 30 x 30 distinct pairs: nothing held twice
    assert len(info.pairs) == 30 * 30 and sum(looked) == len(info.pairs)  # not 30 times each


def test_a_float16_model_is_measured_and_its_widened_copy_compared_in_one_child(tmp_path, children):
    # 2 MiB of float16 weights, external data: the CPU provider's float32 copies would be held beside a session
    # that wrote the optimized model as it opened, so the session measured is let go first and another writes it,
    # with its data at once (the copy of the table's size is compared): one child, where there were two
    from onnxruntime.transformers.float16 import convert_float_to_float16
    vocab, width = 4096, 256
    path = str(tmp_path / "m.onnx")
    onnx.save(convert_float_to_float16(onnx.load(tied(str(tmp_path / "float32.onnx"), vocab, width)),
                                       keep_io_types=True), path, save_as_external_data=True, location="m.onnx.data")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_model(path, str(scratch))
    assert children == [("measure", True)]
    (entry,) = found.vocabulary
    assert entry["in_memory"]["defaults"]["resident_bytes"] is not None
    assert [(c["view"], c["bytes"]) for c in found.runtime_copies if c.get("copy_of") == entry["table"]] \
        == [("widened", vocab * width * 4)]


def test_layered_folder_measured_reads_no_layer_weight_for_its_runtime_copies(tmp_path, reads):
    # onnxruntime folds each layer's Transpose into a copy of the layer's weight: a folder watches only the heads
    # shaped as one of its tables for copies, so no layer weight is read to tell them apart (every head was watched)
    folder = tmp_path / "split"
    folder.mkdir()
    for name in ("a.onnx", "b.onnx"):
        onnx.save(layered(LAYERS), str(folder / name))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_folder(str(folder), str(scratch), isolated.Limits())
    folded = [c for it in found["items"] for c in it["info"].runtime_copies if c["shape"] == [16, 16]]
    assert len(folded) == 2 * LAYERS and not any(c.get("copy_of") for c in folded)
    assert _layer_reads(reads) == {}


@pytest.fixture
def parses(monkeypatch, tmp_path):
    """How many times the parent reads each model file's protobuf (wire.read_file, which read.model.load's parse
    goes through): {its path under tmp_path: times}."""
    from runtime.model.read import wire
    counted, read = collections.Counter(), wire.read_file

    def counting(path, root=None):
        counted[os.path.relpath(os.path.realpath(path), os.path.realpath(tmp_path))] += 1
        return read(path, root)
    monkeypatch.setattr(wire, "read_file", counting)
    return counted


def _retied(argv, capsys):
    from runtime.inspect import cli
    assert cli.main(argv, supervised=False) == 0
    return capsys.readouterr().out


def test_retie_of_a_file_parses_it_once(tmp_path, parses, capsys):
    path = str(tmp_path / "m.onnx")
    onnx.save(layered(LAYERS), path)  # inline: one protobuf holding every weight
    _retied([path, "--retie", str(tmp_path / "out.onnx")], capsys)
    # the original once (what the children wrote, its optimized layout and OUT, are other files)
    originals = {name: n for name, n in parses.items() if name.startswith("m.onnx")}
    assert originals == {"m.onnx": 1}


def test_retie_of_a_folder_parses_each_file_once(tmp_path, parses, capsys):
    folder = tmp_path / "split"
    folder.mkdir()
    for name in ("a.onnx", "b.onnx"):
        onnx.save(layered(LAYERS), str(folder / name))
    _retied([str(folder), "--retie", str(tmp_path / "out")], capsys)
    originals = {name: n for name, n in parses.items() if name.startswith("split")}
    assert originals == {"split/a.onnx": 1, "split/b.onnx": 1}
