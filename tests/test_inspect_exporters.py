"""runtime.inspect and --retie on what onnxruntime-genai's model builder writes (tests/fixtures/make_genai_fixtures.py):
shared embeddings stored once as the head's [width, vocab] weight, in float32 and as 4-bit blocks."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from runtime.inspect.proof import feeds_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
VOCAB, WIDTH, BLOCK = 512, 64, 32  # the config in make_genai_fixtures.py
U = 2.0**-24


def inspect(*args):
    done = subprocess.run([sys.executable, "-m", "runtime.inspect", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def vocabulary(path):
    return json.loads(inspect(path, "--json").stdout)


def test_inspect_genai_fp32_shared_embeddings():
    data = vocabulary(os.path.join(FIXTURES, "genai_fp32", "model.onnx"))
    (entry,) = data["vocabulary"]
    assert {k: entry[k] for k in ("table", "vocab_size", "width", "format", "bytes", "tied", "head")} == {
        "table": "lm_head.MatMul.weight", "vocab_size": VOCAB, "width": WIDTH, "format": "float32",
        "bytes": VOCAB * WIDTH * 4, "tied": True, "head": "lm_head.MatMul.weight"}
    assert entry["tables_in_memory"] == 2  # onnxruntime folds the lookup's Transpose into a second table
    (copy,) = [c for c in data["runtime_copies"] if c.get("copy_of") == "lm_head.MatMul.weight"]
    assert (copy["view"], copy["shape"], copy["bytes"]) == ("transposed", [VOCAB, WIDTH], VOCAB * WIDTH * 4)


def test_inspect_genai_int4_shared_embeddings():
    data = vocabulary(os.path.join(FIXTURES, "genai_int4", "model.onnx"))
    (entry,) = data["vocabulary"]
    packed, scales = VOCAB * WIDTH // 2, VOCAB * (WIDTH // BLOCK) * 4  # two codes a byte; a float32 scale a block
    assert {k: entry[k] for k in ("table", "vocab_size", "width", "format", "bytes", "tied", "head")} == {
        "table": "lm_head.MatMul.weight_Q4", "vocab_size": VOCAB, "width": WIDTH, "format": "int4",
        "bytes": packed + scales, "tied": True, "head": "lm_head.MatMul.weight_Q4"}
    assert entry["tables_in_memory"] == 2  # the Reshape before GatherBlockQuantized is folded into a copy
    (copy,) = [c for c in data["runtime_copies"] if c.get("copy_of") == "lm_head.MatMul.weight_Q4"]
    assert (copy["view"], copy["bytes"]) == ("reshaped", packed)


def test_inspect_summarises_small_runtime_copies():
    out = inspect(os.path.join(FIXTURES, "genai_fp32", "model.onnx")).stdout
    assert "runtime copies under 4096 bytes: 2 (folded constants), 16 bytes in all" in out
    assert "= lm_head.MatMul.weight transposed" in out


def test_retie_genai_fp32_keeps_one_table(tmp_path):
    source = os.path.join(FIXTURES, "genai_fp32", "model.onnx")
    out = tmp_path / "retied.onnx"
    inspect(source, "--retie", out)
    (entry,) = vocabulary(out)["vocabulary"]
    assert (entry["tables_in_memory"], entry["tied"], entry["vocab_size"], entry["width"]) == (1, True, VOCAB, WIDTH)

    # Independently: both models on the same decoder inputs, logits against hidden @ table^T in float64.
    original = onnx.load(source)
    head = [n for n in original.graph.node if n.op_type == "MatMul" and n.input[1] == "lm_head.MatMul.weight"][0]
    original.graph.output.append(helper.make_empty_tensor_value_info(head.input[0]))
    table = numpy_helper.to_array([t for t in original.graph.initializer if t.name == "lm_head.MatMul.weight"][0]).T
    feeds = feeds_for(original, {"input_ids": VOCAB}, np.random.default_rng(3), head_size=16)
    logits_before, hidden = ort.InferenceSession(original.SerializeToString()).run(["logits", head.input[0]], feeds)
    (logits_after,) = ort.InferenceSession(str(out)).run(["logits"], feeds)
    h, t = hidden.astype(np.float64), table.astype(np.float64)
    exact = h @ t.T
    bound = WIDTH * U / (1 - WIDTH * U) * (np.abs(h) @ np.abs(t).T)
    assert logits_before.shape == logits_after.shape == (1, 3, VOCAB)
    assert np.all(np.abs(logits_before - exact) <= bound) and np.all(np.abs(logits_after - exact) <= bound)


def test_retie_genai_int4_says_what_it_leaves(tmp_path):
    done = inspect(os.path.join(FIXTURES, "genai_int4", "model.onnx"), "--retie", tmp_path / "r.onnx")
    assert "lm_head.MatMul.weight_Q4: int4 table read through Reshape by GatherBlockQuantized: left as it is" \
        in done.stdout
    assert not os.listdir(tmp_path)
