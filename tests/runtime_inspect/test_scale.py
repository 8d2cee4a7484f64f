"""What inspect and --retie do so that a model of several GiB costs about one session of it: onnxruntime's optimized
model written for its layout only (the records a full write gives, without the data), the pages of a table read
once let go, the retied model proven where it is placed and placed as proven, one session per model in the proof.
The figures at real sizes are runtime.bench.scale's (tests/test_bench_scale.py runs it at toy sizes)."""
import json
import os

import numpy as np
import onnx
import pytest

import graphs
from graphs.arrays import release
from graphs.storage import stage
from runtime.bench import scale_model
from runtime.inspect.examine import inspect_model
from runtime.model.findings.copies import runtime_copies
from runtime.model.read.model import load
from runtime.model.read.text import InspectError
from runtime.inspect.retie.rewrite import planned
from runtime.inspect.sandbox import folding, isolated, jobs, proof
from runtime.resident import made, owned_bytes, prepacked_copies, resident
from runtime.optimized import write_optimized_layout
from tests.helpers import transposed_head


def _optimized(path, where, sizes):
    """The optimize child's answer for the model at `path` and the optimized model it wrote into `where`."""
    model = load(path)
    os.mkdir(where)
    job = jobs.optimize(jobs.user_model(model.checked), os.path.join(where, "opt.onnx"), where, sizes)
    answer = isolated.call(job, "building its optimized model", isolated.Limits(120), model.file_bytes)
    return model, answer, folding.read_optimized(job["out"], where, answer)


def _records(optimized):
    """What inspect reads of an optimized model: each initializer's name, type and dims, and the prepacked copies."""
    return ([(t.name, t.data_type, list(t.dims)) for t in optimized.proto.graph.initializer],
            prepacked_copies(optimized.proto))


def test_the_layout_alone_gives_the_records_a_full_write_gives(tmp_path):
    path = str(tmp_path / "m.onnx")  # a TorchScript-shaped tied decoder: a head stored transposed, prepacked
    scale_model.generate(path, 2, vocab=300, width=16, hidden=32)
    _, full, written = _optimized(path, str(tmp_path / "full"), None)
    _, layout, unwritten = _optimized(path, str(tmp_path / "layout"), [300 * 16])
    assert full.data and not layout.data  # no tensor of a table's size made: the layout is all it needs
    assert "opt.onnx.data" not in os.listdir(tmp_path / "layout")  # no data written beside it
    assert os.path.getsize(tmp_path / "full" / "opt.onnx.data") > 2 * 300 * 16 * 4  # the table, the head, its copy
    assert _records(unwritten) == _records(written)
    assert any(p["initializer"] == "onnx::MatMul_head" and p["bytes"] >= 300 * 16 * 4
               for p in prepacked_copies(unwritten.proto))
    with pytest.raises(RuntimeError, match="not written"):
        unwritten.tensors["embed.weight"].values()


def test_a_copy_of_a_tables_size_is_told_by_the_node_that_folded_it(tmp_path):
    path = str(tmp_path / "m.onnx")  # the head reads Transpose(table): onnxruntime folds it into a new initializer
    graphs.save(transposed_head(), path)
    model, answer, optimized = _optimized(path, str(tmp_path / "opt"), [16 * 4])
    assert answer.folded and not answer.data  # told by its Transpose, no data file written
    written = sorted(n for n in os.listdir(tmp_path / "opt") if n.startswith("opt"))  # beside the job's files
    assert written == ["opt.onnx"]
    copies = runtime_copies(model, optimized, ["embedding"], answer.folded)
    assert [(c["copy_of"], c["view"]) for c in copies if c.get("copy_of")] == [("embedding", "transposed")]


def test_a_layout_only_load_checks_each_length_against_the_dims(tmp_path):
    path = str(tmp_path / "m.onnx")
    graphs.save(transposed_head(graphs.make_table(64, 4)), path, external=True, check=False)  # 1 KiB: outside
    os.remove(path + ".data")  # no data file at all: the layout is read, nothing opened
    assert load(path, layout_only=True).tensors["embedding"].nbytes == 1024
    with pytest.raises(InspectError, match="opt.onnx.data|m.onnx.data"):
        load(path)  # without layout_only, the missing file is a finding
    proto = onnx.load(path, load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "length":
            entry.value = "12"
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    with pytest.raises(InspectError, match="length 12 but its dims need 1024 bytes"):
        load(path, layout_only=True)


def test_release_lets_a_maps_pages_go_and_keeps_its_values(tmp_path):
    path = tmp_path / "t.bin"
    values = np.random.default_rng(0).standard_normal((2048, 1024), dtype=np.float32)  # 8 MiB
    values.tofile(path)
    mapped = np.memmap(path, np.float32, "r", offset=0, shape=values.shape)
    assert np.array_equal(mapped, values)
    held = resident().file
    release(mapped[:1024])  # the first half's pages
    half = resident().file
    release(mapped.T)  # a transposed view spans them all
    gone = resident().file
    assert held - half >= 3 * 2**20 and half - gone >= 3 * 2**20  # each 4 MiB, less what the kernel kept anyway
    assert np.array_equal(mapped, values)  # read again from the page cache
    release(values)  # an array in memory: nothing to do, nothing changed
    assert values[0, 0] == np.random.default_rng(0).standard_normal((2048, 1024), dtype=np.float32)[0, 0]


def test_a_staged_model_is_placed_as_it_was_written(tmp_path):
    table = graphs.make_table(64, 8)
    model = graphs.tied_logits(table)
    out = tmp_path / "out.onnx"
    staged = stage(model, out, external=True)
    assert not out.exists() and os.path.dirname(staged.path) != str(tmp_path)
    assert staged.path.endswith(os.sep + "out.onnx")  # its final name: the data file it names is its final one
    placed = staged.place()
    assert placed == [str(out), str(out) + ".data"]
    assert os.path.samefile(out, staged.path)  # linked, not written again
    staged.discard()
    assert sorted(os.listdir(tmp_path)) == ["out.onnx", "out.onnx.data"]
    loaded = onnx.load(str(out))
    stored = onnx.numpy_helper.to_array(loaded.graph.initializer[0])
    assert np.array_equal(stored.view(np.uint32), table.view(np.uint32))
    with pytest.raises(FileExistsError):
        stage(model, out, external=True)
    assert sorted(os.listdir(tmp_path)) == ["out.onnx", "out.onnx.data"]  # nothing staged is left


def test_the_proof_opens_one_session_a_model_for_every_feed_set(tmp_path, monkeypatch):
    path = str(tmp_path / "m.onnx")
    graphs.save(transposed_head(), path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_model(path, str(scratch))
    model = found.model
    rewritten, sources, _ = planned(model, found, lambda line: None)
    staged = stage(model.proto, tmp_path / "out.onnx", sources=sources)
    job = json.loads(json.dumps(jobs.prove(  # as the child gets it
        jobs.Proof(path, model.checked, staged.path, rewritten, found.rows, found.shape), str(scratch))))
    opened = []

    class Counted(proof.Runner):
        def __init__(self, onnx_model, **kwargs):
            opened.append(kwargs.get("data_folder"))
            super().__init__(onnx_model, **kwargs)

    monkeypatch.setattr(proof, "Runner", Counted)
    proven = proof.prove(job)
    assert proven[:4] == ([], None, None, None)  # failures, figures, kept, drift
    assert proven.heads["formats"] == ["float32"]  # its logits judged within float32's bound
    assert len(found.shape["lengths"]) >= 2  # several feed sets ...
    assert len(opened) == 2  # ... and one session of each model
    # a single file's retie: the retied model's session is also measured, and writes its optimized model's layout
    job.update(measure=True, layout=str(scratch / "retied.layout.onnx"))
    failures, figures, *_ = proof.prove(job)
    # (what it measures is a fresh process's figure: this one has run sessions before, so only its form is checked)
    assert failures == [] and set(figures) == {"resident_bytes", "anonymous_bytes", "file_bytes", "peak_bytes",
                                               "kept_bytes"}
    alone = scratch / "alone"
    alone.mkdir()
    write_optimized_layout(staged.path, str(alone / "retied.layout.onnx"))  # the same, written by itself
    assert _records(load(job["layout"], layout_only=True)) == _records(
        load(str(alone / "retied.layout.onnx"), layout_only=True))
    staged.discard()


def test_a_model_too_large_to_run_here_is_reported_not_measured(tmp_path, monkeypatch):
    path = str(tmp_path / "m.onnx")
    scale_model.generate(path, 1, vocab=300, width=16, hidden=32)
    model_bytes = load(path).file_bytes
    monkeypatch.setattr(isolated, "available_memory", lambda: model_bytes)  # less than one session of it needs
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_model(path, str(scratch))
    assert found.measure_error.startswith("a session of this model needs about 0.5 GiB, 0.0 GiB is available")
    entry = found.vocabulary[0]["in_memory"]
    assert entry["defaults"]["resident_bytes"] is None and entry["defaults"]["copies"] == 2  # counted, not measured


def test_what_writing_a_layout_holds_is_the_inline_and_the_made_tensors(tmp_path):
    path = str(tmp_path / "m.onnx")  # every weight external: writing the layout holds nothing more
    scale_model.generate(path, 1, vocab=300, width=16, hidden=32)
    layout = str(tmp_path / "layout.onnx")
    write_optimized_layout(path, layout)
    original = onnx.load(path, load_external_data=False)
    assert owned_bytes(original, onnx.load(layout, load_external_data=False)) == 0
    path = str(tmp_path / "t.onnx")  # inline, and the head's Transpose folded into a tensor onnxruntime made
    graphs.save(transposed_head(), path)
    layout = str(tmp_path / "t.layout.onnx")
    write_optimized_layout(path, layout)
    optimized = onnx.load(layout, load_external_data=False)
    made_here = [t.name for t in optimized.graph.initializer if t.name != "embedding"]
    assert [t.name for t in made(onnx.load(path), optimized)] == made_here and len(made_here) == 1
    assert owned_bytes(onnx.load(path), optimized) == 2 * 16 * 4 * 4  # the table inline, and its transposed copy
