"""runtime.bench.scale_model and runtime.bench.scale at toy sizes: the generated model is what it says (a table, and
a head holding it transposed bit for bit, or reading it itself), and every command of the scale section runs to
its end with its figures (no timing asserted)."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from runtime.bench import scale, scale_model

DIMS = {"vocab": 300, "width": 16, "hidden": 32}


@pytest.mark.parametrize("form", scale_model.FORMS)
def test_the_generated_model_is_a_tied_decoder(form, tmp_path):
    path = str(tmp_path / "m.onnx")
    written = scale_model.generate(path, 2, form=form, seed=1, **DIMS)
    model = onnx.load(path)  # its external data beside it
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    table = weights["embed.weight"]
    assert table.shape == (300, 16) and written >= sum(w.nbytes for w in weights.values())
    if form == "torchscript":
        assert np.array_equal(weights["onnx::MatMul_head"].view(np.uint32), table.T.view(np.uint32))
    else:
        assert "onnx::MatMul_head" not in weights
    ids = np.array([[3, 299, 0]], np.int64)
    h = table[ids[0]].astype(np.float64)  # the blocks computed here, in float64, from the stored weights
    for i in range(2):
        h = h + np.maximum(h @ weights[f"blocks.{i}.up"], 0) @ weights[f"blocks.{i}.down"]
    feeds = {"input_ids": ids if form == "torchscript" else ids[0]}
    (logits,) = ort.InferenceSession(path).run(None, feeds)
    assert np.allclose(logits.reshape(3, 300), h @ table.T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_blocks_bring_the_model_near_its_size():
    assert scale_model.blocks_for(2.96) == 8  # 128256 x 2048 twice and 8 blocks of 2 x 2048 x 8192: 2.96 GiB
    assert scale_model.blocks_for(0.001) == 1


@pytest.mark.slow
@pytest.mark.parametrize("form", scale_model.FORMS)
def test_the_scale_section_runs_every_command(form, tmp_path):
    figures = scale.run_size(0.0001, form, str(tmp_path), **DIMS)
    assert {k: f["status"] for k, f in figures.items() if k != "size_bytes"} == {
        "baseline": 0, "inspect": 0, "static": 0, "retie": 0}
    assert all(f["peak_bytes"] > 0 for k, f in figures.items() if k != "size_bytes")
    lines = list(scale.lines(figures))
    assert len(lines) == 4 and lines[1].lstrip().startswith("inspect") and "x (target" in lines[1]
