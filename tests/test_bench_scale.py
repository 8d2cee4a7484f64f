"""runtime.bench.scale_model and runtime.bench.scale at toy sizes: the generated model is what it says (a table, and
a head holding it transposed bit for bit, or reading it itself), and every command of the scale section runs to
its end with its figures (no timing asserted)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from runtime.bench import real_models, scale, scale_model
from tests.helpers import ROOT

DIMS = {"vocab": 300, "width": 16, "hidden": 32}


@pytest.mark.parametrize("form", scale_model.FORMS)
def test_the_generated_model_is_a_tied_decoder(form, tmp_path):
    path = str(tmp_path / "m.onnx")
    written = scale_model.generate(path, 2, form=form, seed=1, **DIMS)
    model = onnx.load(path)  # its external data beside it
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    table = weights["embed.weight"]
    assert table.shape == (300, 16) and written >= sum(w.nbytes for w in weights.values())
    if form != "shared":
        assert np.array_equal(weights["onnx::MatMul_head"].view(np.uint32), table.T.view(np.uint32))
    else:
        assert "onnx::MatMul_head" not in weights
    assert (form == "layered") == (not (tmp_path / "m.onnx.data").exists())  # layered: inline below 2 GiB
    ids = np.array([[3, 299, 0]], np.int64)
    h = table[ids[0]].astype(np.float64)  # the blocks computed here, in float64, from the stored weights
    for i in range(2):
        if form == "layered":  # single-head attention: softmax(q k^T / sqrt(width)) v o, added back
            q, k, v = (h @ weights[f"layers.{i}.attn.{w}"] for w in "qkv")
            scores = q @ k.T / np.sqrt(16)
            mix = np.exp(scores - scores.max(1, keepdims=True))
            h = h + (mix / mix.sum(1, keepdims=True)) @ v @ weights[f"layers.{i}.attn.o"]
        h = h + np.maximum(h @ weights[f"blocks.{i}.up"], 0) @ weights[f"blocks.{i}.down"]
    feeds = {"input_ids": ids[0] if form == "shared" else ids}
    (logits,) = ort.InferenceSession(path).run(None, feeds)
    assert np.allclose(logits.reshape(3, 300), h @ table.T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_blocks_bring_the_model_near_its_size():
    assert scale_model.blocks_for(2.96) == 8  # 128256 x 2048 twice and 8 blocks of 2 x 2048 x 8192: 2.96 GiB
    assert scale_model.blocks_for(0.001) == 1
    # layered: each layer also 4 x 2048 x 2048 of attention (16 MiB each): 16 layers of 192 MiB + 2 GiB of tables
    assert scale_model.blocks_for(2 * 128256 * 2048 * 4 / 2**30 + 16 * 0.1875, form="layered") == 16


def test_a_layered_model_past_the_inline_limit_keeps_its_data_file(tmp_path, monkeypatch):
    monkeypatch.setattr(scale_model, "INLINE_BELOW", 1000)
    scale_model.generate(str(tmp_path / "m.onnx"), 1, form="layered", **DIMS)
    model = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    big = [t for t in model.graph.initializer if t.name != "attn_scale"]
    assert (tmp_path / "m.onnx.data").exists() and all(t.data_location == onnx.TensorProto.EXTERNAL for t in big)


@pytest.mark.slow
@pytest.mark.parametrize("form", scale_model.FORMS)
def test_the_scale_section_runs_every_command(form, tmp_path):
    figures = scale.run_size(0.0001, form, str(tmp_path), **DIMS)
    assert {k: f["status"] for k, f in figures.items() if k != "size_bytes"} == {
        "baseline": 0, "inspect": 0, "static": 0, "retie": 0, **({"keep": 0} if form != "shared" else {})}
    assert all(f["peak_bytes"] > 0 for k, f in figures.items() if k != "size_bytes")
    lines = list(scale.lines(figures))
    assert len(lines) == len(figures) - 1 and lines[1].lstrip().startswith("inspect") and "x (target" in lines[1]


def test_the_scale_region_is_kept_without_figures_and_written_with_them():
    from runtime.bench import markdown
    page = "prose\n<!-- bench:scale -->\nan earlier run's table\n<!-- /bench -->\nmore prose\n"
    run = {"date": "2026-12-02 16:00", "cpu": "a CPU", "cores": 2, "onnxruntime": "1.32.0"}
    assert markdown.render(run, page) == page  # a run without --scale leaves the region as it was
    figure = {"wall_s": 2.0, "peak_bytes": 2 * 2**30, "status": 0, "error": None}
    run["scale"] = [{"size_bytes": 3 * 2**30, "form": "torchscript", "baseline": figure,
                     "inspect": dict(figure, wall_s=5.0, peak_bytes=3 * 2**29), "static": dict(figure, wall_s=0.5),
                     "retie": dict(figure, wall_s=9.0, status=1), "keep": dict(figure, wall_s=10.0)}]
    rows = [line for line in markdown.render(run, page).splitlines() if line.startswith("|")]
    assert rows[2].split("|")[1:-1] == [" 3.00 GiB torchscript ", " plain session ", " 2.0 s ", " 1x ", " 2.00 GiB ",
                                        " 1x "]
    assert "| inspect | 5.0 s | 2.50x | 1.50 GiB | 0.75x |" in markdown.render(run, page)
    assert "| retie (exit 1) | 9.0 s | 4.50x |" in markdown.render(run, page)
    assert "| retie --logits-to-keep 1 | 10.0 s | 5.00x |" in markdown.render(run, page)


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def test_real_models_loads_the_decoder_a_client_loads(tmp_path):
    genai, optimum = os.path.join(FIXTURES, "genai_fp32"), os.path.join(FIXTURES, "optimum_gpt2")
    with open(os.path.join(genai, "genai_config.json")) as f:
        named = json.load(f)["model"]["decoder"]["filename"]
    assert real_models.decoder_of(genai) == os.path.join(genai, named)
    assert real_models.decoder_of(optimum) == os.path.join(optimum, "model.onnx")
    assert real_models.decoder_of(os.path.join(optimum, "model.onnx")) == os.path.join(optimum, "model.onnx")
    for name in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx",
                 "decoder_model_merged.onnx"):
        shutil.copy(os.path.join(optimum, "model.onnx"), tmp_path / name)
    assert real_models.decoder_of(str(tmp_path)) == str(tmp_path / "decoder_model_merged.onnx")


def _figure(wall_s, mib, status=0):
    return {"wall_s": wall_s, "peak_bytes": mib * 2**20, "status": status, "error": None}


def test_real_models_judges_ratios_or_a_short_sessions_allowance():
    figures = {"model": "m", "decoder": "", "size_bytes": 2**30, "interpreters": _figure(2.0, 80),
               "baseline": _figure(4.0, 1000), "inspect": _figure(10.0, 1300), "static": _figure(1.0, 100),
               "retie": _figure(20.4, 1400), "keep": _figure(8.0, 1200, status=1)}
    judged = {name: (round(t, 3), round(p, 3), met) for name, _, t, p, _, met in real_models.judged(figures)}
    # 10 / 4 = 2.5x and 1300 / 1000 = 1.3x: on the targets; 20.4 / 4 = 5.1x > 5x; keep exited 1
    assert judged == {"inspect": (2.5, 1.3, True), "static": (0.25, 0.1, None), "retie": (5.1, 1.4, False),
                      "keep": (2.0, 1.2, False)}
    figures["baseline"] = _figure(1.5, 100)  # shorter than two interpreters started in 2.0 s: within +2 s and +150 MiB
    figures.update(inspect=_figure(3.5, 250), retie=_figure(3.6, 200), keep=_figure(3.0, 251))
    met = {name: ok for name, _, _, _, _, ok in real_models.judged(figures)}
    assert met == {"inspect": True, "static": None, "retie": False, "keep": False}


@pytest.mark.slow
def test_real_models_measures_every_command_against_a_session_that_ran(tmp_path):
    folder = os.path.join(FIXTURES, "genai_fp32")
    with open(os.path.join(folder, "genai_config.json")) as f:
        config = json.load(f)["model"]
    figures = real_models.measure_model(folder, str(tmp_path))
    assert figures["size_bytes"] == sum(e.stat().st_size for e in os.scandir(folder))
    assert {k: figures[k]["status"] for k in ("interpreters", "baseline", "inspect", "static", "retie", "keep")} == {
        "interpreters": 0, "baseline": 0, "inspect": 0, "static": 0, "retie": 0, "keep": 0}
    decoder = config["decoder"]
    kv = [1, decoder["num_key_value_heads"], real_models.TOKENS, decoder["head_size"]]  # empty pasts + 4 tokens
    outputs = figures["baseline"]["outputs"]
    assert outputs["logits"] == [1, real_models.TOKENS, config["vocab_size"]]
    assert len(outputs) == 1 + 2 * decoder["num_hidden_layers"] and outputs["present.0.key"] == kv
    lines = list(real_models.lines(figures))
    assert lines[0].startswith(f"{folder} (decoder model.onnx)") and "plain session" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["inspect", "static", "retie", "retie"]
    rows = real_models.markdown_table([figures])
    assert len(rows) == 2 + 5 and rows[2].startswith("| genai_fp32 (model.onnx)") and "| retie | " in rows[5]
    assert os.listdir(tmp_path) == []  # the scratch folder removed


def test_real_models_takes_each_figures_median_on_its_own():
    # the median wall time and the median peak of one command's runs, each on its own; a failure is not hidden
    runs = [_figure(3.0, 10), _figure(1.0, 30), _figure(2.0, 20)]
    assert real_models.median(runs) == _figure(2.0, 20)
    failing = runs[:2] + [{**_figure(9.0, 5, status=1), "error": "boom"}]
    assert real_models.median(failing) == {**_figure(3.0, 10, status=1), "error": "boom"}
    baseline = [{**_figure(1.0, 10), "outputs": {"logits": [1, 4, 8]}}, _figure(2.0, 20)]
    assert real_models.median(baseline)["outputs"] == {"logits": [1, 4, 8]}


def test_scale_refuses_a_repeat_it_cannot_run(tmp_path):
    done = subprocess.run([sys.executable, "-m", "runtime.bench.scale", "--model", str(tmp_path), "--repeat", "0"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith("--repeat: from 1 to 99")
