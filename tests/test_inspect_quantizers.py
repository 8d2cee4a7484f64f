"""runtime.inspect on the exports and quantizer outputs of tests/fixtures/make_more_*_fixtures.py (versions and
Hugging Face's own parameter counts in more_fixtures.json): Gemma (genai and Optimum: rows scaled by sqrt(width)),
Gemma2 (a sliding window the proof must feed), a Llama whose int4 codes are padded past its width, and
onnxruntime's quantize_dynamic and MatMulNBitsQuantizer applied to a tied export."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from runtime.inspect.sandbox import feeds
from runtime.inspect.sandbox.feeds import feeds_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
MADE = json.load(open(os.path.join(FIXTURES, "more_fixtures.json")))
VOCAB, WIDTH = 512, 64


def run(*args):
    return subprocess.run([sys.executable, "-m", "runtime.inspect", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def report(name, *args):
    done = run(os.path.join(FIXTURES, name, "model.onnx"), "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def token_entry(data):
    (entry,) = [v for v in data["vocabulary"] if v["kind"] == "token"]
    return entry


def test_fixtures_record_their_makers_and_versions():
    for name, made in MADE.items():
        assert os.path.exists(os.path.join(FIXTURES, name, "model.onnx")), name
        assert made["versions"]["onnxruntime"] and made["num_parameters"] > 0


def test_parameter_shares_match_hugging_faces_count():
    for name in ("genai_gemma", "optimum_gemma", "genai_gemma2_fp32", "genai_llama_int4_padded", "ortquant_dynamic",
                 "ortquant_nbits", "ortquant_nbits_folded"):
        entry = token_entry(report(name))
        expected = MADE[name]["num_parameters"]
        assert abs(entry["parameters_counted"] - expected) <= 0.005 * expected, (name, entry["parameters_counted"])
        width = MADE[name]["config"].get("hidden_size", WIDTH)
        assert entry["parameter_share"] == round(VOCAB * width / entry["parameters_counted"], 4)


def test_gemma_rows_are_scaled_by_sqrt_width():
    for name in ("genai_gemma", "optimum_gemma"):
        entry = token_entry(report(name))
        assert (entry["row_scale"], entry["row_scale_is_sqrt_width"], entry["tied"]) == (8.0, True, True), name
    entry = token_entry(report("optimum_gemma"))
    assert entry["tables_in_memory"] >= 1 and entry["head"] != entry["table"]  # stored twice by Optimum
    plain = token_entry(json.loads(run(os.path.join(FIXTURES, "genai_fp32", "model.onnx"), "--json").stdout))
    assert plain["row_scale"] is None  # Qwen2 does not scale its rows


def test_a_padded_int4_width_is_the_models_and_stays_tied(tmp_path):
    config = MADE["genai_llama_int4_padded"]["config"]
    entry = token_entry(report("genai_llama_int4_padded"))
    assert (entry["width"], entry["padded_width"], entry["tied"]) == (config["hidden_size"], 96, True)
    out = tmp_path / "retied.onnx"
    done = run(os.path.join(FIXTURES, "genai_llama_int4_padded", "model.onnx"), "--retie", out)
    assert done.returncode == 0, done.stderr
    after = json.loads(run(out, "--json").stdout)
    retied = token_entry(after)
    assert (retied["width"], retied["tied"]) == (config["hidden_size"], True)
    # the export's folded Reshape held a second packed table; the retied model holds the codes once (prepacking
    # off: with it on, MatMulNBits' own packed copy is the second)
    assert entry["in_memory"]["no_prepacking"]["copies"] == 2 and retied["in_memory"]["no_prepacking"]["copies"] == 1
    source = onnx.load(os.path.join(FIXTURES, "genai_llama_int4_padded", "model.onnx"))
    inputs = feeds_for(source, {"input_ids": VOCAB}, np.random.default_rng(1), head_size=16)
    names = [o.name for o in source.graph.output]
    before = ort.InferenceSession(source.SerializeToString()).run(names, inputs)
    now = ort.InferenceSession(str(out)).run(names, inputs)
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(before, now))


def test_a_sliding_window_sets_the_proofs_past():
    model = onnx.load(os.path.join(FIXTURES, "genai_gemma2_fp32", "model.onnx"), load_external_data=False)
    shape = feeds.plan(model, os.path.join(FIXTURES, "genai_gemma2_fp32", "model.onnx"))
    window = MADE["genai_gemma2_fp32"]["config"]["sliding_window"]
    assert shape["past"] == window and shape["head_size"] == 16 and "window" in shape["why"]
    entry = token_entry(report("genai_gemma2_fp32"))
    assert entry["in_memory"]["defaults"]["resident_bytes"] is not None  # the model ran on those feeds


def test_a_model_that_cannot_run_is_never_blamed_on_the_retie(tmp_path):
    out = tmp_path / "retied.onnx"
    done = run(os.path.join(FIXTURES, "genai_gemma2_fp32", "model.onnx"), "--retie", out, "--proof-past", "4")
    assert done.returncode == 2 and not out.exists()
    line = done.stderr.strip().splitlines()[-1]
    assert "cannot be proven on this machine" in line and "the original model" in line and "past 4" in line
    assert "Traceback" not in done.stderr
    bad = run(os.path.join(FIXTURES, "genai_gemma2_fp32", "model.onnx"), "--proof-past", "-1")
    assert bad.returncode == 2 and "--proof-past" in bad.stderr


def test_plan_reads_windows_and_context_from_the_files_beside(tmp_path):
    graph = helper.make_graph([helper.make_node("GroupQueryAttention", ["q"], ["y"], domain="com.microsoft",
                                                local_window_size=48, num_heads=2, kv_num_heads=1)], "g",
                              [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 1, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 32])])
    model = helper.make_model(graph)
    path = tmp_path / "model.onnx"
    assert feeds.plan(model, path)["past"] == 48
    (tmp_path / "config.json").write_text(json.dumps({"sliding_window": 60, "max_position_embeddings": 62}))
    shape = feeds.plan(model, path)
    assert (shape["past"], shape["lengths"]) == (60, [1])  # 60 + 3 would pass the model's 62 positions
    assert feeds.plan(model, path, past=7)["past"] == 7


def test_quantize_dynamic_head_is_a_quantized_copy_not_a_tie():
    data = report("ortquant_dynamic")
    entry = token_entry(data)
    (pair,) = [p for p in data["pairs"] if p["relation"] == "quantized_copy"]
    assert not entry["tied"] and entry["quantized_head"]["head"] == pair["head"] == "lm_head.MatMul.weight_quantized"
    # the largest difference, computed here from the file: (code - zero point) x scale against the float table
    model = onnx.load(os.path.join(FIXTURES, "ortquant_dynamic", "model.onnx"))
    tensors = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    codes = tensors["lm_head.MatMul.weight_quantized"].astype(np.float64)
    scale = float(tensors["lm_head.MatMul.weight_scale"])
    zero = float(tensors["lm_head.MatMul.weight_zero_point"])
    gap = np.max(np.abs((codes - zero) * scale - tensors["lm_head.MatMul.weight"])) / scale
    assert abs(pair["max_error_in_scales"] - gap) <= 1e-3 and gap <= 0.5 + 1e-6


def test_matmulnbits_quantizer_head_is_a_quantized_copy():
    data = report("ortquant_nbits")
    (pair,) = [p for p in data["pairs"] if p["head"] == "lm_head.MatMul.weight_Q4"]
    assert pair["relation"] == "quantized_copy" and pair["max_error_in_scales"] <= 1 + 2**-10
    assert not token_entry(data)["tied"]


def test_one_int4_table_in_two_layouts_is_a_duplicate_and_retie_keeps_one(tmp_path):
    data = report("ortquant_nbits_folded")
    (pair,) = [p for p in data["pairs"] if p["relation"] == "duplicate"]
    # INT4 [512, 64] two codes a byte, and its float32 scales [512, 2]
    assert (pair["table"], pair["head"], pair["wasted_bytes"]) == (
        "model.embed_tokens.weight_Q4", "lm_head.MatMul.weight_Q4", VOCAB * WIDTH // 2 + VOCAB * 2 * 4)
    source = os.path.join(FIXTURES, "ortquant_nbits_folded", "model.onnx")
    out = tmp_path / "retied.onnx"
    done = run(source, "--retie", out)
    assert done.returncode == 0, done.stderr
    retied = onnx.load(out)
    assert not [t for t in retied.graph.initializer if t.data_type == TensorProto.INT4]
    assert os.path.getsize(out) < os.path.getsize(source)
    original = onnx.load(source)
    inputs = feeds_for(original, {"input_ids": VOCAB}, np.random.default_rng(2), head_size=16)
    names = [o.name for o in original.graph.output]
    before = ort.InferenceSession(original.SerializeToString()).run(names, inputs)
    now = ort.InferenceSession(str(out)).run(names, inputs)
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(before, now))


def test_a_qdq_head_holding_the_table_quantized_is_found(tmp_path):
    rng = np.random.default_rng(4)
    table = rng.standard_normal((40, 16)).astype(np.float32)
    scale = (np.abs(table).max(axis=1) / 127).astype(np.float32)  # per token: the head's axis 1 of [width, vocab]
    codes = np.clip(np.rint(table / scale[:, None]), -127, 127).astype(np.int8).T.copy()
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"]),
         helper.make_node("DequantizeLinear", ["head_q", "head_scale"], ["head"], axis=1),
         helper.make_node("MatMul", ["rows", "head"], ["logits"])], "qdq",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, 40])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(codes, "head_q"),
         numpy_helper.from_array(scale, "head_scale")])
    path = tmp_path / "qdq.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    data = json.loads(run(path, "--json").stdout)
    (pair,) = data["pairs"]
    expected = np.max(np.abs(codes.T.astype(np.float64) * scale[:, None] - table) / scale[:, None])
    assert pair["relation"] == "quantized_copy" and abs(pair["max_error_in_scales"] - expected) <= 1e-3
    assert not data["vocabulary"][0]["tied"]


def test_gemma2_soft_capped_head_is_retied_and_proven(tmp_path):
    source = os.path.join(FIXTURES, "genai_gemma2_fp32", "model.onnx")
    out = tmp_path / "retied.onnx"
    done = run(source, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert token_entry(report("genai_gemma2_fp32"))["tables_in_memory"] == 2
    assert token_entry(json.loads(run(out, "--json").stdout))["tables_in_memory"] == 1
    # logits = 30 tanh(h t^T / 30): both models within float32's bound of the exact value, computed here
    original = onnx.load(source)
    head = [n for n in original.graph.node if n.op_type == "MatMul" and n.input[1] == "lm_head.MatMul.weight"][0]
    original.graph.output.append(helper.make_empty_tensor_value_info(head.input[0]))
    table = numpy_helper.to_array([t for t in original.graph.initializer if t.name == "lm_head.MatMul.weight"][0]).T
    shape = feeds.plan(original, source)
    inputs = feeds_for(original, {"input_ids": VOCAB}, np.random.default_rng(6), 16, shape["past"], 3)
    before, hidden = ort.InferenceSession(original.SerializeToString()).run(["logits", head.input[0]], inputs)
    (after,) = ort.InferenceSession(str(out)).run(["logits"], inputs)
    h, t = hidden.astype(np.float64), table.astype(np.float64)
    exact = 30 * np.tanh(h @ t.T / 30)
    u = 2.0**-24
    bound = WIDTH * u / (1 - WIDTH * u) * (np.abs(h) @ np.abs(t).T) + 16 * u * np.abs(exact) + 1e-30
    assert np.all(np.abs(before - exact) <= bound) and np.all(np.abs(after - exact) <= bound)


def test_int8_and_uint8_with_zero_point_128_are_one_table(tmp_path):
    rng = np.random.default_rng(8)
    table = rng.standard_normal((40, 16)).astype(np.float32)
    scale = (np.abs(table).max(axis=1) / 127).astype(np.float32)
    codes = np.clip(np.rint(table / scale[:, None]), -127, 127).astype(np.int8)  # [vocab, width], per token
    shifted = (codes.astype(np.int16) + 128).astype(np.uint8).T.copy()  # the same codes + 128, [width, vocab]
    other = shifted.copy()
    other[0, 0] ^= 1  # one code off: not the same table
    for head_codes, relation in ((shifted, "transposed_duplicate"), (other, "distinct")):
        graph = helper.make_graph(
            [helper.make_node("DequantizeLinear", ["table_q", "table_scale"], ["table"], axis=0),
             helper.make_node("Gather", ["table", "ids"], ["rows"]),
             helper.make_node("DequantizeLinear", ["head_q", "head_scale", "head_zero"], ["head"], axis=1),
             helper.make_node("MatMul", ["rows", "head"], ["logits"])], "qdq",
            [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, 40])],
            [numpy_helper.from_array(codes, "table_q"), numpy_helper.from_array(scale, "table_scale"),
             numpy_helper.from_array(head_codes, "head_q"), numpy_helper.from_array(scale, "head_scale"),
             numpy_helper.from_array(np.full(40, 128, np.uint8), "head_zero")])
        path = tmp_path / f"{relation}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
        done = run(path, "--json")
        assert done.returncode == 0, done.stderr
        (pair,) = json.loads(done.stdout)["pairs"]
        assert pair["relation"] == relation
        if relation != "distinct":
            assert pair["wasted_bytes"] == 40 * 16 + 40 * 4 + 40  # the uint8 codes, float32 scales, zero points
