"""runtime.inspect and --retie on what real exporters write: onnxruntime-genai's model builder
(tests/fixtures/make_genai_fixtures.py: shared embeddings stored once as the head's [width, vocab] weight, float32
and 4-bit blocks, and untied) and Optimum (tests/fixtures/make_optimum_fixture.py: GPT-2 with and without a KV
cache, tied and untied)."""
import json
import math
import os
import subprocess
import sys
import tempfile
import tracemalloc

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

import graphs
from runtime.inspect.examine import inspect_model
from runtime.inspect.retie.write import retie
from runtime.inspect.sandbox import isolated
from runtime.inspect.sandbox.feeds import feeds_for

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


def folded(data):
    """The runtime copies onnxruntime's optimized model holds (not the ones kernels prepack at load)."""
    return [c for c in data["runtime_copies"] if c.get("view") != "prepacked"]


def prepacked(data, name):
    return [(c["kernel"], c["bytes"]) for c in data["runtime_copies"] if c.get("view") == "prepacked"
            and c["copy_of"] == name]


def test_inspect_genai_fp32_shared_embeddings():
    data = vocabulary(os.path.join(FIXTURES, "genai_fp32", "model.onnx"))
    (entry,) = data["vocabulary"]
    assert {k: entry[k] for k in ("table", "vocab_size", "width", "format", "bytes", "tied", "head")} == {
        "table": "lm_head.MatMul.weight", "vocab_size": VOCAB, "width": WIDTH, "format": "float32",
        "bytes": VOCAB * WIDTH * 4, "tied": True, "head": "lm_head.MatMul.weight"}
    # onnxruntime folds the lookup's Transpose into a second table, and prepacks the head's weight into a third,
    # freeing the original (its only reader packed it): two copies under the defaults, two with prepacking off
    assert entry["tables_in_memory"] == 2
    assert [entry["in_memory"][s]["copies"] for s in ("defaults", "no_prepacking")] == [2, 2]
    assert entry["onnxruntime"] == ort.__version__  # whose folding and prepacking these counts are
    (copy,) = [c for c in folded(data) if c.get("copy_of") == "lm_head.MatMul.weight"]
    assert (copy["view"], copy["shape"], copy["bytes"]) == ("transposed", [VOCAB, WIDTH], VOCAB * WIDTH * 4)
    assert prepacked(data, "lm_head.MatMul.weight") == [("MatMul", VOCAB * WIDTH * 4)]


def test_inspect_genai_int4_shared_embeddings():
    data = vocabulary(os.path.join(FIXTURES, "genai_int4", "model.onnx"))
    (entry,) = data["vocabulary"]
    packed, scales = VOCAB * WIDTH // 2, VOCAB * (WIDTH // BLOCK) * 4  # two codes a byte; a float32 scale a block
    assert {k: entry[k] for k in ("table", "vocab_size", "width", "format", "bytes", "tied", "head")} == {
        "table": "lm_head.MatMul.weight_Q4", "vocab_size": VOCAB, "width": WIDTH, "format": "int4",
        "bytes": packed + scales, "tied": True, "head": "lm_head.MatMul.weight_Q4"}
    # the Reshape before GatherBlockQuantized is folded into a copy, and MatMulNBits prepacks the codes (freeing them)
    assert entry["tables_in_memory"] == 2
    (copy,) = [c for c in folded(data) if c.get("copy_of") == "lm_head.MatMul.weight_Q4"]
    assert (copy["view"], copy["bytes"]) == ("reshaped", packed)
    assert [kernel for kernel, _ in prepacked(data, "lm_head.MatMul.weight_Q4")] == ["MatMulNBits"]


def test_inspect_genai_fp16_counts_the_float32_copy():
    """onnxruntime's CPU provider runs the float16 head through a float32 MatMul: the inserted Cast is folded into a
    float32 copy of the table (beside the Transpose's float16 copy), and inspect says whose it is."""
    data = vocabulary(os.path.join(FIXTURES, "genai_fp16", "model.onnx"))
    (entry,) = data["vocabulary"]
    # the stored table is dropped once both its readers are folded; the float32 copy is prepacked and then freed:
    # a float16 copy and a packed float32 one under the defaults, three tensors with prepacking off
    assert (entry["format"], entry["bytes"], entry["tied"], entry["tables_in_memory"]) == (
        "float16", VOCAB * WIDTH * 2, True, 2)
    views = sorted((c["view"], c["bytes"]) for c in folded(data) if c.get("copy_of") == entry["table"])
    assert views == [("transposed", VOCAB * WIDTH * 2), ("widened", VOCAB * WIDTH * 4)]
    (widened,) = [c["name"] for c in folded(data) if c.get("view") == "widened" and c["copy_of"] == entry["table"]]
    assert prepacked(data, widened) == [("MatMul", VOCAB * WIDTH * 4)]


def test_inspect_summarises_small_runtime_copies():
    out = inspect(os.path.join(FIXTURES, "genai_fp32", "model.onnx")).stdout
    assert "runtime copies under 4096 bytes: 2 (folded constants), 16 bytes in all" in out
    assert "= lm_head.MatMul.weight transposed" in out


def logits_against_exact(source, retied, head_weight, table_of, rows, head_size):
    """Both models on the same decoder inputs; each one's logits against hidden @ table^T in float64."""
    original = onnx.load(source)
    head = [n for n in original.graph.node if n.op_type == "MatMul" and n.input[1] == head_weight][0]
    original.graph.output.append(helper.make_empty_tensor_value_info(head.input[0]))
    table = table_of(numpy_helper.to_array([t for t in original.graph.initializer if t.name == head_weight][0]))
    feeds = feeds_for(original, rows, np.random.default_rng(3), head_size=head_size)
    logits_before, hidden = ort.InferenceSession(original.SerializeToString()).run(["logits", head.input[0]], feeds)
    (logits_after,) = ort.InferenceSession(str(retied)).run(["logits"], feeds)
    h, t = hidden.astype(np.float64), table.astype(np.float64)
    exact = h @ t.T
    bound = WIDTH * U / (1 - WIDTH * U) * (np.abs(h) @ np.abs(t).T)
    assert logits_before.shape == logits_after.shape == (1, 3, VOCAB)
    assert np.all(np.abs(logits_before - exact) <= bound) and np.all(np.abs(logits_after - exact) <= bound)


def test_retie_genai_fp32_keeps_one_table(tmp_path):
    source = os.path.join(FIXTURES, "genai_fp32", "model.onnx")
    out = tmp_path / "retied.onnx"
    inspect(source, "--retie", out)
    (entry,) = vocabulary(out)["vocabulary"]
    assert (entry["tables_in_memory"], entry["tied"], entry["vocab_size"], entry["width"]) == (1, True, VOCAB, WIDTH)
    logits_against_exact(source, out, "lm_head.MatMul.weight", lambda w: w.T, {"input_ids": VOCAB}, head_size=16)


def test_inspect_optimum_gpt2_finds_the_transposed_duplicate(tmp_path):
    source = os.path.join(FIXTURES, "optimum_gpt2", "model.onnx")
    data = vocabulary(source)
    by_table = {v["table"]: v for v in data["vocabulary"]}
    assert by_table["transformer.wpe.weight"]["tied"] is False  # positions: a table with no head
    wte = by_table["transformer.wte.weight"]
    assert (wte["vocab_size"], wte["width"], wte["tied"], wte["tables_in_memory"]) == (VOCAB, WIDTH, True, 2)
    (pair,) = [p for p in data["pairs"] if p["relation"] != "distinct"]
    assert (pair["relation"], pair["wasted_bytes"]) == ("transposed_duplicate", VOCAB * WIDTH * 4)

    out = tmp_path / "retied.onnx"  # the proof feeds past_key_values, attention_mask and position_ids consistently
    inspect(source, "--retie", out)
    wte = {v["table"]: v for v in vocabulary(out)["vocabulary"]}["transformer.wte.weight"]
    assert (wte["tied"], wte["head"], wte["tables_in_memory"]) == (True, "transformer.wte.weight", 1)
    logits_against_exact(source, out, pair["head"], lambda w: w.T, {"input_ids": VOCAB}, head_size=None)


def test_retie_genai_int4_gathers_the_packed_codes_in_place(tmp_path):
    source = os.path.join(FIXTURES, "genai_int4", "model.onnx")
    out = tmp_path / "retied.onnx"
    inspect(source, "--retie", out)
    (entry,) = vocabulary(out)["vocabulary"]
    packed, scales = VOCAB * WIDTH // 2, VOCAB * (WIDTH // BLOCK) * 4
    # the codes once, read in place by the lookup, and MatMulNBits' prepacked copy (which keeps the head fast; the
    # export holds two as well: the folded Reshape's copy and the packed one); the lookup reads the one scales
    # tensor through a run-time view, so the retied file adds no tensor but a few shape constants
    assert (entry["tables_in_memory"], entry["tied"], entry["format"]) == (2, True, "int4")
    assert entry["in_memory"]["no_prepacking"]["copies"] == 1
    assert (entry["vocab_size"], entry["width"], entry["bytes"]) == (VOCAB, WIDTH, packed + scales)
    retied = onnx.load(out)
    assert sum(math.prod(t.dims) for t in retied.graph.initializer) - sum(
        math.prod(t.dims) for t in onnx.load(source, load_external_data=False).graph.initializer) <= 16
    gather = [n for n in retied.graph.node if n.op_type == "GatherBlockQuantized"][0]
    assert gather.input[0] == "lm_head.MatMul.weight_Q4"  # no Reshape in front of it any more

    # Nothing else changed: every output of the two models agrees bit for bit on the same decoder inputs.
    original = onnx.load(source)
    feeds = feeds_for(original, {"input_ids": VOCAB}, np.random.default_rng(5), head_size=16)
    names = [o.name for o in original.graph.output]
    before = ort.InferenceSession(original.SerializeToString()).run(names, feeds)
    after = ort.InferenceSession(str(out)).run(names, feeds)
    for name, a, b in zip(names, before, after):
        assert a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), name


def test_untied_exports_are_never_called_tied(tmp_path):
    for name, table in (("torchscript_untied.onnx", "embed.weight"), ("dynamo_untied.onnx", "embed.weight"),
                        ("genai_fp32_untied/model.onnx", "model.embed_tokens.weight"),
                        ("genai_int4_untied/model.onnx", "model.embed_tokens.weight"),
                        ("optimum_gpt2_untied/model.onnx", "transformer.wte.weight")):
        path = os.path.join(FIXTURES, name)
        data = vocabulary(path)
        (entry,) = [v for v in data["vocabulary"] if v["table"] == table]
        assert (entry["tied"], entry["head"], entry["tables_in_memory"]) == (False, None, 1), name
        assert all(p["relation"] == "distinct" for p in data["pairs"]), name
        out = tmp_path / (name.replace("/", "_") + ".retied.onnx")
        assert "nothing to do" in inspect(path, "--retie", out).stdout and not out.exists(), name


def test_retie_optimum_without_kv_cache(tmp_path):
    source = os.path.join(FIXTURES, "optimum_gpt2_nokv", "model.onnx")
    assert not [i for i in onnx.load(source).graph.input if "past" in i.name]
    (pair,) = [p for p in vocabulary(source)["pairs"] if p["relation"] != "distinct"]
    assert pair["relation"] == "transposed_duplicate"
    out = tmp_path / "retied.onnx"
    inspect(source, "--retie", out)
    wte = {v["table"]: v for v in vocabulary(out)["vocabulary"]}["transformer.wte.weight"]
    assert (wte["tied"], wte["tables_in_memory"]) == (True, 1)
    logits_against_exact(source, out, pair["head"], lambda w: w.T, {"input_ids": VOCAB}, head_size=None)


def test_retie_streams_tables_instead_of_loading_them(tmp_path):
    """The genai fp32 form with a 128 MiB external table, retied in this process: the table is transposed and
    written a block at a time (never whole in memory), and what is written is the table, bit for bit."""
    vocab, width = 1 << 19, 64
    weight = np.random.default_rng(0).standard_normal((width, vocab)).astype(np.float32)  # stored [width, vocab]
    nodes = [helper.make_node("Transpose", ["W"], ["WT"], perm=[1, 0]), helper.make_node("Gather", ["WT", "ids"], ["h"]),
             helper.make_node("MatMul", ["h", "W"], ["logits"])]
    graph = helper.make_graph(nodes, "genai_form", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["n", vocab])],
                              [numpy_helper.from_array(weight, "W")])
    source = tmp_path / "model.onnx"
    graphs.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source, external=True)
    del graph, nodes
    out = tmp_path / "retied.onnx"
    tracemalloc.start()
    try:
        with tempfile.TemporaryDirectory() as folder:
            info = inspect_model(source, folder)
            assert retie(info["model"], info, out, folder, isolated.Limits(), lambda line: None) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < weight.nbytes / 3, f"{peak} bytes at the peak for a {weight.nbytes}-byte table"
    retied = onnx.load(out)
    (rows,) = [t for t in retied.graph.initializer if t.name != "W" and list(t.dims) == [vocab, width]]
    assert np.array_equal(numpy_helper.to_array(rows).view(np.uint32), weight.T.view(np.uint32))
