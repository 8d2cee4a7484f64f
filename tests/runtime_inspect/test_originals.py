"""The original model's outputs on the proof's feeds, given ahead by inspect's child (sandbox.originals): where a
--retie will prove the model and a session of its own writes the layout, that session shows the heads' hidden
vectors and runs the proof's feeds, and the proof reads what it saved instead of loading the original again. The
saved outputs must be what the proof's own session of the original gives, bit for bit, on the very feeds the proof
makes; anything else is not taken. A value is shown only where no fusion of onnxruntime's reads it: the layout
that session writes is the report's, the same as without a retie to come."""
import json
import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from graphs.storage import stage
from runtime.inspect.examine import inspect_model
from runtime.inspect.retie.rewrite import planned
from runtime.inspect.sandbox import isolated, jobs, originals, proof
from runtime.model.read.model import load
from tests.helpers import inspected, model_of, one_line_error, run_inspect


def _model(tmp_path, before="Tanh", after=False, scale=None, vocab=512, width=1024, external=False):
    """A tied head (through a Transpose) reading a hidden vector made by `before` ("Tanh", or "Mul" by a scalar
    `scale`), its product the logits unless `after` (then a bias Add follows); 2 MiB inline, so a session of its
    own writes the layout (onnxruntime folds the Transpose into a copy of the table). With `external`, the head's
    weight a transposed copy of the table stored beside it (TorchScript's tied export; nothing folded) and both in
    a data file: the session measured then writes the layout. Its path."""
    rng = np.random.default_rng(7)
    extra = [numpy_helper.from_array(np.array(scale, np.float32), "scale")] if scale is not None else []
    product = "product" if after else "logits"
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["embeddings"]),
             helper.make_node(before, ["x"] + (["scale"] if scale is not None else []), ["hidden"]),
             helper.make_node("MatMul", ["hidden", "t"], [product])]
    if not external:
        nodes.insert(2, helper.make_node("Transpose", ["embedding"], ["t"], perm=[1, 0]))
    if after:
        nodes.append(helper.make_node("Add", [product, "bias"], ["logits"]))
        extra.append(numpy_helper.from_array(rng.standard_normal(vocab).astype(np.float32), "bias"))
    values = rng.standard_normal((vocab, width)).astype(np.float32)
    table = numpy_helper.from_array(values, "embedding")
    if external:
        extra.append(numpy_helper.from_array(np.ascontiguousarray(values.T), "t"))
    path = str(tmp_path / "m.onnx")
    graphs.save(model_of(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                                 helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
                         [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["n", width]),
                          helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", vocab])],
                         [table] + extra), path, external=external)
    return path


def _inspected(path, where, proving):
    os.mkdir(where)
    return inspect_model(path, str(where), isolated.Limits(300, proving=proving))


def _ahead(tmp_path, external=False):
    """(the model's path, inspect_model's Findings with a retie to come, the proof's feed sets, the values it shows)."""
    path = _model(tmp_path, external=external)
    info = _inspected(path, tmp_path / "scratch", True)
    return path, info, proof.proof_feeds({"rows": info.rows, "shape": info.shape}, info.model.proto), \
        ["hidden"]


@pytest.mark.parametrize("external", [False, True])  # the layout written apart, or by the session measured
def test_the_outputs_given_ahead_are_the_proofs_own_run_of_the_original_bit_for_bit(tmp_path, external):
    path, info, feed_sets, watched = _ahead(tmp_path, external)
    olds = originals.given(info.originals, feed_sets, watched)
    assert olds is not None and len(olds) == len(feed_sets) >= 2  # every step of the proof, the hidden vector shown
    session, shown = proof._original(load(path).proto, str(tmp_path), watched, True)  # as the proof opens it
    for old, run in zip(olds, proof.run_each(session, shown, [f for _, f in feed_sets])):
        mine = proof.outputs_of(run)
        assert sorted(old) == sorted(mine) == ["embeddings", "hidden", "logits"]
        for name, value in mine.items():
            assert old[name].dtype == value.dtype and old[name].shape == value.shape
            assert np.array_equal(old[name].view(np.uint8), value.view(np.uint8)), name


def test_outputs_run_on_other_feeds_or_showing_other_values_are_not_taken(tmp_path):
    _, info, feed_sets, watched = _ahead(tmp_path)
    said, feeds = feed_sets[0]
    other = dict(feeds, ids=feeds["ids"] ^ 1)  # one bit of one feed
    assert originals.given(info.originals, [(said, other)] + feed_sets[1:], watched) is None
    assert originals.given(info.originals, feed_sets[1:], watched) is None  # not the same steps
    assert originals.given(info.originals, feed_sets, watched + ["embeddings"]) is None  # not what it showed
    assert originals.given(info.originals, feed_sets, watched) is not None


def test_an_unreadable_file_of_outputs_is_not_taken(tmp_path):
    _, info, feed_sets, watched = _ahead(tmp_path)
    saved = info.originals["path"]
    with open(saved, "r+b") as f:
        f.truncate(os.path.getsize(saved) // 2)
    assert originals.given(info.originals, feed_sets, watched) is None
    os.remove(saved)
    assert originals.given(info.originals, feed_sets, watched) is None


def _seen(info):
    """What the report says onnxruntime holds: the copies it made and the ones its kernels prepacked."""
    return info.runtime_copies, info.prepacked


@pytest.mark.parametrize("before, after, scale, external", [("Tanh", False, None, False), ("Mul", False, 2.0, False),
                                                             ("Tanh", True, None, False), ("Tanh", False, None, True)])
def test_the_report_is_the_same_with_a_retie_to_come(tmp_path, before, after, scale, external):
    # a hidden vector MatMulScaleFusion folds into the head (Mul by a scalar), or a product MatMul + Add -> Gemm
    # reads (a bias after the head): shown as an output, the fusion would not be made and the layout, whose kernels
    # and copies the report says, would be another model's; so nothing is shown there
    path = _model(tmp_path, before, after, scale, external=external)
    found = {proving: _inspected(path, tmp_path / str(proving), proving) for proving in (True, False)}
    assert _seen(found[True]) == _seen(found[False]) and found[False].originals is None
    assert (found[True].originals is None) == (before == "Mul" or after)
    assert any(c.get("copy_of") == "embedding" for c in found[True].runtime_copies) != external  # the folded
    # Transpose; the stored copy's session measured shows the hidden vector (a few KiB more): its layout the same


def test_nothing_is_run_ahead_without_a_retie_to_come(tmp_path):
    info = _inspected(_model(tmp_path), tmp_path / "scratch", False)
    assert info.originals is None and "originals.npz" not in os.listdir(tmp_path / "scratch")


@pytest.mark.parametrize("ahead", [True, False])
def test_the_proof_opens_no_session_of_the_original_where_its_outputs_were_given_ahead(tmp_path, monkeypatch, ahead):
    path, info, _, _ = _ahead(tmp_path)
    model = info.model
    rewritten, sources, _ = planned(model, info, lambda line: None)
    staged = stage(model.proto, tmp_path / "out.onnx", sources=sources)
    job = json.loads(json.dumps(jobs.prove(jobs.Proof(  # as the child gets it
        path, model.checked, staged.path, rewritten, info.rows, info.shape,
        originals=info.originals if ahead else None), str(tmp_path))))
    opened = []

    class Counted(proof.Runner):
        def __init__(self, onnx_model, **kwargs):
            opened.append(onnx_model)
            super().__init__(onnx_model, **kwargs)

    monkeypatch.setattr(proof, "Runner", Counted)
    proven = proof.prove(job)
    staged.discard()
    assert rewritten and proven.failures == [] and proven.heads["formats"] == ["float32"]  # proven either way
    assert len(opened) == (1 if ahead else 2)  # the retied model's session, and the original's unless given ahead


def test_a_retie_proven_on_outputs_given_ahead_writes_what_it_proved(tmp_path):
    out = tmp_path / "fixed.onnx"
    done = inspected(_model(tmp_path), "--retie", out)
    assert "every other output bit for bit" in " ".join(done.stdout.split()) and out.exists()


def test_an_original_onnxruntime_refuses_on_the_proofs_feeds_stops_the_retie_before_its_proof(tmp_path):
    """Where inspect's child runs the original on the proof's feeds ahead and onnxruntime refuses one of them (a
    float16 export on the CPU provider, or here a Reshape to the 3 positions of the proof's first step and of the
    client's first run, which its second step's 1 fails), the retie stops there with the line the
    proof's own run would give: no retied model is written or proven (SmolLM2's genai fp16: 5.6 s and 1.8 GB of
    a refusal -> 3.4 s, 1.4 GB)."""
    from runtime.inspect.retie.write import Plan, proven_at
    from runtime.model.read.text import InspectError
    vocab, width = 512, 1024
    values = np.random.default_rng(7).standard_normal((vocab, width)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["embeddings"]),
             helper.make_node("Reshape", ["x", "three"], ["r"]),  # 3 positions: others fail at run time
             helper.make_node("Tanh", ["r"], ["hidden"]),
             helper.make_node("Transpose", ["embedding"], ["t"], perm=[1, 0]),
             helper.make_node("MatMul", ["hidden", "t"], ["logits"])]
    path = str(tmp_path / "m.onnx")
    graphs.save(model_of(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                                 helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
                         [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["n", width]),
                          helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", vocab])],
                         [numpy_helper.from_array(values, "embedding"),
                          numpy_helper.from_array(np.array([3, width], np.int64), "three")]), path)
    info = _inspected(path, tmp_path / "scratch", True)
    refused = info.originals["refused"]
    assert refused.startswith("onnxruntime cannot run the original model on the proof's feeds (") and \
        refused.endswith("(--proof-past N sets the past length)"), refused
    plan = Plan(load(path), info, [], {})
    with pytest.raises(InspectError, match="cannot be proven on this machine, nothing written: onnxruntime cannot"):
        proven_at(plan, "never-staged.onnx", str(tmp_path), isolated.Limits(300, proving=True))  # no child: no file
    done = run_inspect(path, "--retie", str(tmp_path / "out.onnx"))
    assert one_line_error(done.returncode, done.stderr, "cannot be proven on this machine, nothing written", refused)
    assert not os.path.exists(tmp_path / "out.onnx")


def test_a_folders_sessions_measured_give_the_originals_ahead_bit_for_bit(tmp_path):
    """A folder's files measured together (work.measure_together): a file whose session writes its layout as it
    opens shows the heads' hidden vectors and runs the proof's feeds too, so the proof loads it no more (the
    Qwen2.5-shaped no-accelerate folder's --retie: 15.3 s -> 11.7 s); what it saved is the proof's own run of the
    original, bit for bit."""
    from runtime.inspect.examine_folder import inspect_folder
    folder = tmp_path / "folder"
    folder.mkdir()
    path = _model(folder, external=True)  # external data: the session measured writes the layout
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_folder(str(folder), str(scratch), isolated.Limits(300, proving=True))
    (item,) = found["items"]
    info, watched = item["info"], ["hidden"]
    feed_sets = proof.proof_feeds({"rows": info.rows, "shape": info.shape}, info.model.proto)
    olds = originals.given(info.originals, feed_sets, watched)
    assert olds is not None and len(olds) == len(feed_sets) >= 2
    session, shown = proof._original(load(path).proto, str(folder), watched, True)
    for old, run in zip(olds, proof.run_each(session, shown, [f for _, f in feed_sets])):
        mine = proof.outputs_of(run)
        assert sorted(old) == sorted(mine) == ["embeddings", "hidden", "logits"]
        for name, value in mine.items():
            assert old[name].dtype == value.dtype and np.array_equal(old[name].view(np.uint8),
                                                                     value.view(np.uint8)), name
