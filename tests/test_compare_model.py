"""compare --model: the lab on a model's own table. Decoding is checked against embed's own quantize / dequantize
(the table stored by graphs' builders in each format) and against the initializers read with numpy; the real
SmolLM2 table's facts are computed here with numpy from the GGUF file (tests/fixtures/smollm2.py)."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import embed
import graphs
from runtime.compare.real import figures
from runtime.compare.real.source import read_table
from tests.helpers import FIXTURES, ROOT, refused


def run_compare(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "runtime.compare", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def small_model(tmp_path, fmt="float32", block_size=None, vocab=300, width=32, name="model.onnx"):
    table = graphs.make_table(vocab, width, 3)
    path = tmp_path / name
    graphs.save(graphs.tied_logits(table, fmt=fmt, block_size=block_size), path)
    return path, table


# --- the table read as its lookup reads it -----------------------------------------------------------------------

@pytest.mark.parametrize("fmt, block", [("float32", None), ("float16", None), ("bfloat16", None), ("int8", 32),
                                        ("int4", 32), ("int8", 24), ("int4", 16)])
def test_the_table_is_decoded_as_embed_dequantizes_it(tmp_path, fmt, block):
    path, table = small_model(tmp_path, fmt, block, width=48)
    codes, scales = embed.quantize(table.tolist(), fmt, block)
    expected = np.asarray(embed.dequantize(codes, scales, fmt, block), np.float32)  # the reference's rows
    found = read_table(str(path))
    assert (found.values.shape, found.values.dtype) == (expected.shape, np.float32)
    assert np.array_equal(found.values.view(np.uint32), expected.view(np.uint32))
    assert found.tied and found.format == fmt


@pytest.mark.parametrize("weight_type", ["QUInt8", "QInt8"])
def test_a_quantize_dynamic_table_is_what_its_lookup_gives(tmp_path, weight_type):
    """onnxruntime's quantize_dynamic on a Gather: int8 codes, then DequantizeLinear after the Gather. The table
    compare reads is every row the quantized model's lookup gives, run by onnxruntime, and numpy's decoding."""
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic
    graphs.save(graphs.gather_lookup(graphs.make_table(300, 32, 3)), tmp_path / "float.onnx")
    quantize_dynamic(tmp_path / "float.onnx", tmp_path / "q.onnx", op_types_to_quantize=["Gather"],
                     weight_type=getattr(QuantType, weight_type))
    rows = ort.InferenceSession(tmp_path / "q.onnx").run(["embeddings"], {"ids": np.arange(300)[None]})[0][0]
    tensors = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "q.onnx").graph.initializer}
    codes, scale = tensors["embedding_quantized"].astype(np.int64), tensors["embedding_scale"]
    decoded = ((codes - tensors["embedding_zero_point"].astype(np.int64)) * scale.astype(np.float64)).astype(np.float32)
    found = read_table(str(tmp_path / "q.onnx"))
    assert np.array_equal(found.values, rows) and np.array_equal(found.values, decoded)
    assert found.format == tensors["embedding_quantized"].dtype.name  # the codes as stored


def test_a_table_stored_transposed_is_read_by_rows_with_its_row_scale():
    folder = os.path.join(FIXTURES, "genai_gemma")  # the head's [width, vocab] weight, Transpose -> Gather, x 8.0
    found = read_table(folder)
    model = onnx.load(os.path.join(folder, "model.onnx"))
    weight = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "lm_head.MatMul.weight")
    assert np.array_equal(found.values, weight.T) and found.tied
    assert found.row_scale == 8.0 and found.row_scale_is_sqrt_width is True


def test_a_float32_table_in_a_data_file_is_read_in_place(tmp_path):
    path, table = small_model(tmp_path)
    graphs.save(graphs.tied_logits(table), tmp_path / "ext.onnx", external=True)
    found = read_table(str(tmp_path / "ext.onnx"))
    assert isinstance(found.values, np.memmap) and np.array_equal(found.values, table)


def test_the_fp32_variant_of_a_transformers_js_folder_is_read(tmp_path):
    onnx_dir = tmp_path / "onnx"
    onnx_dir.mkdir()
    _, table = small_model(onnx_dir, "float32")
    small_model(onnx_dir, "float16", name="model_fp16.onnx")
    for config in (False, True):  # with config.json, a transformers.js folder as inspect reads its variants
        if config:
            (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
        for where in (tmp_path, onnx_dir):
            found = read_table(str(where))
            assert found.model.endswith(os.path.join("onnx", "model.onnx")) and np.array_equal(found.values, table)
    os.remove(onnx_dir / "model.onnx")  # no fp32 variant: the first there is
    found = read_table(str(tmp_path))
    assert found.model.endswith(os.path.join("onnx", "model_fp16.onnx")) and found.format == "float16"


def test_a_hub_cache_snapshot_is_read_in_place_with_its_tokenizer(tmp_path):
    from tests.runtime_inspect.test_hostile_folders import hub_snapshot
    path, table = small_model(tmp_path)
    tokenizer(tmp_path, [f"w{i}" for i in range(300)])
    snapshot = hub_snapshot(tmp_path, {n: (tmp_path / n).read_bytes() for n in ("model.onnx", "tokenizer.json")})
    found = read_table(str(snapshot))
    assert np.array_equal(found.values, table) and found.tied
    done = run_compare("--model", snapshot, "--query", "w5", "--k", "3", "--json", "-")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["table"]["queries"][0]["token"] == "w5"


# --- the command -----------------------------------------------------------------------------------------------

def tokenizer(tmp_path, tokens):
    """A word-level tokenizer.json naming `tokens` by id (split on whitespace)."""
    data = {"version": "1.0", "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(tokens)}, "unk_token": tokens[0]}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))


def test_compare_model_checks_the_lab_on_the_table_and_reports_it(tmp_path):
    path, table = small_model(tmp_path)
    tokenizer(tmp_path, [f"w{i}" for i in range(300)])
    done = run_compare("--model", path, "--query", "w7,12", "--k", "5", "--json", tmp_path / "out.json")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["passed"] and {c["name"] for c in data["checks"] if c["passed"]} == {
        "lookup", "onehot_lookup", "neighbors", "stretch", "scaled"}
    assert all(c["passed"] is None for c in data["checks"] if c["info"])
    found = data["table"]
    assert (found["vocab_size"], found["width"], found["values"], found["bytes"]) == (300, 32, 9600, 38400)
    assert found["tied"] and found["doubled_vocab"] == {"tied_bytes": 76800, "untied_bytes": 153600}
    lengths = np.linalg.norm(table.astype(np.float64), axis=1)
    assert found["norms"]["max"] == pytest.approx(lengths.max())
    assert found["norms"]["min"] == pytest.approx(lengths.min())
    assert [r["id"] for r in found["longest"]] == list(np.argsort(-lengths, kind="stable")[:5])
    assert [q["token"] for q in found["queries"]] == ["w7", "w12"]
    for q in found["queries"]:  # numpy's own rankings (no near-ties in this table at these k)
        dots = table.astype(np.float64) @ table[q["id"]].astype(np.float64)
        cosines = dots / lengths / lengths[q["id"]]
        for metric, scores in (("dot", dots), ("cosine", cosines)):
            ranked = [t for t in np.argsort(-scores, kind="stable") if t != q["id"]][:5]
            assert [e["id"] for e in q[metric]] == ranked
            assert [e["token"] for e in q[metric]] == [f"w{t}" for t in ranked]
    logits = table.astype(np.float64) @ table.T.astype(np.float64)
    assert found["self_score"]["checked"] == 300 and not found["self_score"]["sampled"]
    assert found["self_score"]["not_first"] == int(np.count_nonzero(logits.argmax(1) != np.arange(300)))
    lines = done.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("w7 (id 7,"))
    assert first <= 4 and "by cosine" in lines[first + 1] and "by dot product" in lines[first + 1]  # the first screen
    assert max(map(len, lines)) <= 120


def test_the_self_score_count_is_numpys_argmax_of_the_whole_product():
    rng = np.random.default_rng(5)
    values = (rng.standard_normal((700, 24)) * rng.uniform(0.2, 3.0, (700, 1)) + 0.8).astype(np.float32)
    values[[10, 20, 300]] = values[0] * 4  # equal rows: ties go to the lower id, as argmax takes the first
    found = figures.self_score(values)
    plain = values.astype(np.float64)
    centered = plain - plain.mean(0)
    for table, key in ((plain, "not_first"), (centered, "not_first_centered")):
        logits = table @ table.T
        assert found[key] == int(np.count_nonzero(logits.argmax(1) != np.arange(700)))
    assert 0 < found["not_first"] and found["top"][found["top"] != found["tokens"]].size == found["not_first"]


@pytest.mark.parametrize("args, words", [
    (["--vocab-size", "64"], ["--vocab-size", "--model"]), (["--width", "8"], ["--width"]),
    (["--seed", "1"], ["--seed"]),
    (["--format", "int8"], ["--format"]), (["--query", "300"], ["300", "[0, 300)"]),
    (["--query", "w1 w2"], ["2 tokens", "w1", "w2"]), (["--table", "nope"], ["--table nope"])])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, words):
    path, _ = small_model(tmp_path)
    tokenizer(tmp_path, [f"w{i}" for i in range(300)])
    assert refused(run_compare("--model", path, *args), *words)


def test_a_text_query_without_a_tokenizer_and_a_model_without_a_table_are_refused(tmp_path):
    path, _ = small_model(tmp_path)
    assert refused(run_compare("--model", path, "--query", "Paris"), "Paris", "tokenizer")
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    onnx.save(onnx.helper.make_model(graph), tmp_path / "relu.onnx")
    assert refused(run_compare("--model", tmp_path / "relu.onnx"), "no token table")
    assert refused(run_compare("--model", tmp_path / "missing.onnx"), "no such file")


def test_the_shared_reader_sits_below_both_commands():
    """runtime.model imports neither command nor onnxruntime; compare --model reads through it, not inspect."""
    def imported(module):
        done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        return {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    below = imported("runtime.model.found")
    assert "runtime.model.found" in below and not {m for m in below if m.startswith(("runtime.inspect",
                                                                                     "runtime.compare", "onnxruntime"))}
    compare = imported("runtime.compare.real.cli")
    assert "runtime.model.read.model" in compare and not {m for m in compare if m.startswith("runtime.inspect")}
    inspect = imported("runtime.inspect.cli")
    assert "runtime.model.read.model" in inspect and not {m for m in inspect if m.startswith("runtime.compare")}


# --- a real trained table: SmolLM2-135M-Instruct -------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from tests.fixtures import smollm2
    return smollm2.folder(), smollm2.read_gguf()[0]


@pytest.mark.slow
def test_the_real_table_shows_what_the_issue_saw(smollm2, tmp_path):
    folder, table = smollm2
    done = run_compare("--model", folder, "--json", tmp_path / "out.json")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "out.json").read_text())["table"]
    lengths = np.linalg.norm(table.astype(np.float64), axis=1)
    assert (data["vocab_size"], data["width"], data["tied"]) == (49152, 576, True)
    assert data["norms"]["min"] == pytest.approx(lengths.min()) and data["norms"]["max"] == pytest.approx(lengths.max())
    assert data["longest"][0]["token"] == "Ġstrugg" and data["longest"][0]["id"] == int(lengths.argmax())
    paris = next(q for q in data["queries"] if q["token"] == "ĠParis")
    dots = table.astype(np.float64) @ table[paris["id"]].astype(np.float64)
    for metric, scores in (("dot", dots), ("cosine", dots / lengths / lengths[paris["id"]])):
        ranked = [int(t) for t in np.argsort(-scores, kind="stable") if t != paris["id"]][:8]
        assert [e["id"] for e in paris[metric]] == ranked
    assert paris["dot"][0]["token"] == "<filename>" and paris["cosine"][1]["token"] == "ĠLondon"
    found = data["self_score"]
    assert found["checked"] == 49152 and not found["sampled"]
    sample = np.arange(0, 49152, 97)  # the claim on every 97th token, with numpy's whole product for each
    top = np.concatenate([(table[sample[i:i + 64]] @ table.T).argmax(1) for i in range(0, len(sample), 64)])
    share = np.count_nonzero(top != sample) / len(sample)
    assert abs(found["not_first"] / 49152 - share) < 0.03  # about 90 % either way
    assert data["hubs"]["rows"][0]["token"] == "Ġstrugg" and data["hubs"]["rows"][0]["in_dot_lists"] > 1800


@pytest.mark.slow
def test_a_gguf_file_is_read_with_its_own_vocabulary(smollm2, tmp_path):
    from tests.fixtures.smollm2 import gguf_path
    _, table = smollm2
    found = read_table(gguf_path())
    assert np.array_equal(found.values, table) and found.tied and found.format == "Q8_0"
    done = run_compare("--model", gguf_path(), "--query", " Paris", "--json", "-")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)["table"]
    assert data["queries"][0]["token"] == "ĠParis" and data["queries"][0]["cosine"][0]["token"] == "Paris"
