"""What inspect finds (runtime.model.graph and .findings): tables, heads and how each pair relates (shared,
duplicate, transposed, a quantized copy), parameter shares, row scales and position tables, on the lab's own graphs,
on torch, onnxruntime-genai and Optimum exports, and on onnxruntime's quantizers (tests/fixtures/make_*_fixtures.py;
versions and Hugging Face's own parameter counts in more_fixtures.json)."""
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from graphs.export import FILES
from tests.helpers import (
    FIXTURES,
    ROOT,
    MADE,
    TORCH_TABLE_BYTES,
    VOCAB,
    WIDTH,
    findings,
    folded,
    inspect_cli,
    inspected,
    many_tables,
    model_in,
    model_of,
    relations,
    run_inspect,
    token_entry,
)


# --- the lab's own graphs ---------------------------------------------------------------------------------------------

OWN_PAIRS = {
    "gather_lookup.onnx": [], "onehot_lookup.onnx": [], "scaled_lookup.onnx": [],
    "tied_logits.onnx": [("embedding", "embedding", "shared", 0)],
    "untied_logits.onnx": [("embedding", "lm_head", "distinct", 0)],
    "neighbors_dot.onnx": [("embedding", "embedding", "shared", 0)],
    "neighbors_cosine.onnx": [("embedding", "embedding", "shared", 0)],
}


@pytest.mark.parametrize("name", FILES)  # every graph export writes: one missing above is a KeyError
def test_inspect_own_graphs(exported, name):
    data = findings(exported / name)
    assert relations(data) == OWN_PAIRS[name]
    assert data["file_bytes"] == os.path.getsize(exported / name)
    table = [i for i in data["initializers"] if i["name"] == "embedding"][0]
    assert (table["dtype"], table["shape"], table["elements"], table["bytes"]) == ("float32", [64, 8], 512, 2048)
    assert not [c for c in folded(data) if c["bytes"] >= 2048]  # no table is copied
    # under onnxruntime's defaults too: only the untied head and the one-hot product's MatMul prepack what they
    # multiply by, and the original is then freed
    prepacked = [c["copy_of"] for c in data["runtime_copies"] if c.get("view") == "prepacked"]
    assert prepacked == {"untied_logits.onnx": ["lm_head"], "onehot_lookup.onnx": ["embedding"]}.get(name, [])
    assert [v["tables_in_memory"] for v in data["vocabulary"]] == [1] * len(data["vocabulary"])


def test_the_labs_onehot_product_is_a_table_read(tmp_path):
    table = graphs.make_table(64, 8)
    path = tmp_path / "onehot_lookup.onnx"
    graphs.save(graphs.onehot_lookup(table), path)
    done = run_inspect(path, "--json")
    assert done.returncode == 0, done.stderr
    (entry,) = json.loads(done.stdout)["vocabulary"]
    assert (entry["table"], entry["vocab_size"], entry["width"], entry["kind"]) == ("embedding", 64, 8, "token")


def test_position_tables_are_labelled(tmp_path):
    positions = graphs.make_table(16, 8, seed=1)
    tokens = graphs.make_table(32, 8)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["wte", "input_ids"], ["t"]), helper.make_node("Gather", ["wpe", "position_ids"], ["p"]),
         helper.make_node("Add", ["t", "p"], ["h"])], "gpt",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n"]),
         helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(tokens, "wte"), numpy_helper.from_array(positions, "wpe")])
    path = tmp_path / "gpt.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    kinds = {v["table"]: v["kind"] for v in findings(path)["vocabulary"]}
    assert kinds == {"wte": "token", "wpe": "position"}
    out = run_inspect(path).stdout
    assert "vocabulary: position table wpe 16 x 8" in out and "vocabulary: table wte 32 x 8" in out


@pytest.mark.slow
def test_inspect_finds_a_plain_duplicate(tmp_path):
    table = graphs.make_table(40, 6)
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["embeddings"], axis=0),
             helper.make_node("Gemm", ["hidden", "head"], ["logits"], transB=1)]
    graph = helper.make_graph(nodes, "dup", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                                             helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", 6])],
                              [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["n", 6]),
                               helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 40])],
                              [numpy_helper.from_array(table, "embedding"), numpy_helper.from_array(table.copy(), "head")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = tmp_path / "dup.onnx"
    onnx.save(model, path)
    assert relations(findings(path)) == [("embedding", "head", "duplicate", 40 * 6 * 4)]
    out = tmp_path / "retied.onnx"
    assert run_inspect(path, "--retie", out).returncode == 0
    retied = onnx.load(out)
    assert [t.name for t in retied.graph.initializer if len(t.dims) == 2] == ["embedding"]
    assert all(math.prod(t.dims) <= 2 for t in retied.graph.initializer if t.name != "embedding")  # the view's shapes
    assert relations(findings(out)) == [("embedding", "embedding", "shared", 0)]


@pytest.mark.parametrize("head, relation", [("permuted", "distinct"), ("transposed", "transposed_duplicate"),
                                            ("one_bit", "distinct")])
def test_a_head_with_the_tables_values_in_another_order_is_not_a_copy(head, relation, tmp_path):
    # the digest that spares comparisons sees values, not their order: a head holding the table's rows shuffled
    # fingerprints alike and must be told apart value by value; one flipped bit must not fingerprint alike
    table = graphs.make_table(40, 6)
    values = {"permuted": table[np.random.default_rng(0).permutation(40)].T, "transposed": table.T,
              "one_bit": table.T.copy()}[head]
    if head == "one_bit":
        values.view(np.uint32)[3, 7] ^= 1
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["embeddings"], axis=0),
             helper.make_node("MatMul", ["hidden", "head"], ["logits"])]
    graph = helper.make_graph(nodes, "order", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                                               helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", 6])],
                              [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["n", 6]),
                               helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 40])],
                              [numpy_helper.from_array(table, "embedding"),
                               numpy_helper.from_array(np.ascontiguousarray(values), "head")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, tmp_path / "order.onnx")
    done = run_inspect(tmp_path / "order.onnx", "--static", "--json")
    wasted = 40 * 6 * 4 if relation != "distinct" else 0
    assert relations(json.loads(done.stdout)) == [("embedding", "head", relation, wasted)]


def test_many_tables_and_heads_take_seconds_not_minutes(tmp_path):
    path = tmp_path / "many.onnx"
    onnx.save(many_tables(400), path)
    start = time.monotonic()
    code, out, err = inspect_cli(path, timeout=300)
    assert code == 0, err
    assert "160000 table/head pairs of matching shape distinct (listed under --verbose)" in out
    assert time.monotonic() - start < 120  # a hang guard for a shared machine: it takes about 5 s here


# --- real exports -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, table, relation, wasted", [
    ("torchscript_tied", "embed.weight", "transposed_duplicate", TORCH_TABLE_BYTES),
    ("torchscript_untied", "embed.weight", "distinct", 0),
    ("dynamo_tied", "lm_head.weight", "transposed_duplicate", TORCH_TABLE_BYTES),
    ("dynamo_untied", "embed.weight", "distinct", 0),
])
def test_inspect_torch_exports(name, table, relation, wasted):
    data = findings(os.path.join(FIXTURES, name + ".onnx"))
    pairs = [p for p in data["pairs"] if p["table"] == table]
    assert [(p["relation"], p["wasted_bytes"]) for p in pairs] == [(relation, wasted)]
    assert not [c for c in folded(data) if c["bytes"] >= TORCH_TABLE_BYTES]


def test_inspect_optimum_gpt2_finds_the_transposed_duplicate():
    data = findings(model_in("optimum_gpt2"))
    by_table = {v["table"]: v for v in data["vocabulary"]}
    assert by_table["transformer.wpe.weight"]["tied"] is False  # positions: a table with no head
    wte = by_table["transformer.wte.weight"]
    assert (wte["vocab_size"], wte["width"], wte["tied"], wte["tables_in_memory"]) == (VOCAB, WIDTH, True, 2)
    (pair,) = [p for p in data["pairs"] if p["relation"] != "distinct"]
    assert (pair["relation"], pair["wasted_bytes"]) == ("transposed_duplicate", VOCAB * WIDTH * 4)


UNTIED = [("torchscript_untied.onnx", "embed.weight"), ("dynamo_untied.onnx", "embed.weight"),
          ("genai_fp32_untied/model.onnx", "model.embed_tokens.weight"),
          ("genai_int4_untied/model.onnx", "model.embed_tokens.weight"),
          ("optimum_gpt2_untied/model.onnx", "transformer.wte.weight")]


@pytest.mark.parametrize("name, table", UNTIED, ids=[n.split("/")[0].removesuffix(".onnx") for n, _ in UNTIED])
def test_untied_exports_are_never_called_tied(name, table, tmp_path):
    path = os.path.join(FIXTURES, name)
    data = findings(path)
    (entry,) = [v for v in data["vocabulary"] if v["table"] == table]
    assert (entry["tied"], entry["head"], entry["tables_in_memory"]) == (False, None, 1)
    assert all(p["relation"] == "distinct" for p in data["pairs"])
    out = tmp_path / "retied.onnx"
    assert "nothing to do" in inspected(path, "--retie", out).stdout and not out.exists()


def test_fixtures_record_their_makers_and_versions():
    for name, made in MADE.items():
        assert os.path.exists(os.path.join(FIXTURES, name, "model.onnx")), name
        assert made["versions"]["onnxruntime"] and made["num_parameters"] > 0


@pytest.mark.parametrize("name", ["genai_gemma", "optimum_gemma", "genai_gemma2_fp32", "genai_llama_int4_padded",
                                  "ortquant_dynamic", "ortquant_nbits", "ortquant_nbits_folded"])
def test_parameter_shares_match_hugging_faces_count(name):
    entry = token_entry(findings(model_in(name)))
    expected = MADE[name]["num_parameters"]
    assert abs(entry["parameters_counted"] - expected) <= 0.005 * expected, entry["parameters_counted"]
    width = MADE[name]["config"].get("hidden_size", WIDTH)
    assert entry["parameter_share"] == round(VOCAB * width / entry["parameters_counted"], 4)


def test_gemma_rows_are_scaled_by_sqrt_width():
    for name in ("genai_gemma", "optimum_gemma"):
        entry = token_entry(findings(model_in(name)))
        assert (entry["row_scale"], entry["row_scale_is_sqrt_width"], entry["tied"]) == (8.0, True, True), name
    plain = token_entry(findings(model_in("genai_fp32")))
    assert plain["row_scale"] is None  # Qwen2 does not scale its rows


def test_optimum_gemma_stores_its_table_twice_and_holds_two():
    """Optimum keeps Gemma's head as its own [width, vocab] MatMul weight beside the [vocab, width] table: a
    transposed duplicate in the file. onnxruntime keeps the table for the Gather and prepacks the head's weight
    (freeing the original): two tables in memory under the defaults, and two with prepacking off."""
    data = findings(model_in("optimum_gemma"))
    entry = token_entry(data)
    assert (entry["table"], entry["head"]) == ("model.embed_tokens.weight", "onnx::MatMul_504")
    assert relations(data) == [("model.embed_tokens.weight", "onnx::MatMul_504", "transposed_duplicate",
                                VOCAB * WIDTH * 4)]
    assert entry["tables_in_memory"] == 2
    assert [entry["in_memory"][s]["copies"] for s in ("defaults", "no_prepacking")] == [2, 2]
    assert [(c["copy_of"], c["kernel"], c["bytes"]) for c in data["runtime_copies"] if c.get("view") == "prepacked"] \
        == [("onnx::MatMul_504", "MatMul", VOCAB * WIDTH * 4)]


def test_a_padded_int4_width_is_the_models_and_stays_tied():
    config = MADE["genai_llama_int4_padded"]["config"]
    entry = token_entry(findings(model_in("genai_llama_int4_padded")))
    assert (entry["width"], entry["padded_width"], entry["tied"]) == (config["hidden_size"], 96, True)
    # the export's folded Reshape holds a second packed table (prepacking off: with it on, MatMulNBits' own packed
    # copy is the second); test_retie.py reties it to one
    assert entry["in_memory"]["no_prepacking"]["copies"] == 2


# --- quantizers -------------------------------------------------------------------------------------------------------

def test_quantize_dynamic_head_is_a_quantized_copy_not_a_tie():
    data = findings(model_in("ortquant_dynamic"))
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


def decoded_gap(tensors, codes, scale, zero, head, head_scale, head_zero, transposed):
    a = (tensors[codes].astype(np.float64) - float(tensors[zero])) * float(tensors[scale])
    b = (tensors[head].astype(np.float64) - float(tensors[head_zero])) * float(tensors[head_scale])
    b = b.T if transposed else b
    return np.max(np.abs(a - b)) / ((float(tensors[scale]) + float(tensors[head_scale])) / 2)


@pytest.mark.parametrize("name, table, head", [
    ("gpt2", "transformer.wte.weight_quantized", "onnx::MatMul_399_quantized"),  # DequantizeLinear after Gather
    ("tinylm", "embed.weight_quantized", "onnx::MatMul_12_quantized")])           # the codes into MatMulInteger
def test_quantize_dynamic_with_gather_is_a_quantized_copy(name, table, head):
    # failed on the main before issue 29: the pair was "distinct"
    path = os.path.join(FIXTURES, "ortquant_gather", f"{name}.onnx")
    data = findings(path)
    (pair,) = [p for p in data["pairs"] if p["table"] == table and p["head"] == head]
    tensors = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    base, head_base = table[:-len("_quantized")], head[:-len("_quantized")]
    gap = decoded_gap(tensors, table, base + "_scale", base + "_zero_point", head, head_base + "_scale",
                      head_base + "_zero_point", transposed=True)
    assert pair["relation"] == "quantized_copy" and abs(pair["max_error_in_scales"] - gap) <= 1e-4
    assert gap <= 1 + 2**-10  # two roundings of the same floats, each within half its scale
    assert pair["wasted_bytes"] == tensors[head].nbytes + 4 + 1  # the head's codes, its scale and zero point
    (entry,) = [v for v in data["vocabulary"] if v["table"] == table]
    assert not entry["tied"] and entry["quantized_head"]["head"] == head


def test_matmulnbits_quantizer_head_is_a_quantized_copy():
    data = findings(model_in("ortquant_nbits"))
    (pair,) = [p for p in data["pairs"] if p["head"] == "lm_head.MatMul.weight_Q4"]
    assert pair["relation"] == "quantized_copy" and pair["max_error_in_scales"] <= 1 + 2**-10
    assert not token_entry(data)["tied"]


def test_one_int4_table_in_two_layouts_is_a_duplicate():
    data = findings(model_in("ortquant_nbits_folded"))
    (pair,) = [p for p in data["pairs"] if p["relation"] == "duplicate"]
    # INT4 [512, 64] two codes a byte, and its float32 scales [512, 2]
    assert (pair["table"], pair["head"], pair["wasted_bytes"]) == (
        "model.embed_tokens.weight_Q4", "lm_head.MatMul.weight_Q4", VOCAB * WIDTH // 2 + VOCAB * 2 * 4)


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
    data = findings(path)
    (pair,) = data["pairs"]
    expected = np.max(np.abs(codes.T.astype(np.float64) * scale[:, None] - table) / scale[:, None])
    assert pair["relation"] == "quantized_copy" and abs(pair["max_error_in_scales"] - expected) <= 1e-3
    assert not data["vocabulary"][0]["tied"]


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
        (pair,) = findings(path)["pairs"]
        assert pair["relation"] == relation
        if relation != "distinct":
            assert pair["wasted_bytes"] == 40 * 16 + 40 * 4 + 40  # the uint8 codes, float32 scales, zero points


def test_a_block_wider_than_the_row_leaves_the_table_its_own_width(tmp_path):
    # was "256 x 32 int4" for codes stored [256, 8] (block 32), and the head then went unpaired
    done = subprocess.run([sys.executable, "-m", "graphs.export", str(tmp_path), "--width", "8", "--format", "int4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    codes = [t for t in onnx.load(tmp_path / "tied_logits.onnx").graph.initializer if t.name == "embedding"]
    assert [list(t.dims) for t in codes] == [[256, 8]]
    (entry,) = findings(tmp_path / "tied_logits.onnx", "--static")["vocabulary"]
    assert (entry["vocab_size"], entry["width"], entry["format"]) == (256, 8, "int4")
    assert entry["tied"] and entry["tie_relation"] == "shared"


def test_a_transposed_copy_is_compared_bit_for_bit_in_every_tile(tmp_path):
    # the comparison reads tiles of 256 columns where they lie: a bit flipped in any tile, the last ragged one too,
    # makes the copy distinct; the same NaN bits are the same values
    from runtime.model.findings.relations import same_values
    from runtime.model.read.model import load
    table = np.random.default_rng(3).standard_normal((700, 600)).astype(np.float32)
    table[5, 7] = np.float32("nan")
    for row, col in ((None, None), (0, 0), (699, 599), (350, 300)):
        head = table.T.copy()
        if row is not None:
            head.view(np.uint32)[col, row] ^= 1
        model = model_of([], [], [], [numpy_helper.from_array(table, "t"), numpy_helper.from_array(head, "h")])
        onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data")
        tensors = load(str(tmp_path / "m.onnx")).tensors
        assert same_values(tensors["t"], tensors["h"], transposed=True) is (row is None), (row, col)
