"""What --retie rewrites, proves and writes (runtime.inspect.retie, and the proof the sandbox runs): one rule
for what is rewritten, static shapes, a head sharing its table that still prepacks it, a OneHot product's table,
real exports and quantizers retied with their logits checked against float32's bound here, a proof that fails,
and OUT: never overwritten, never half written, never claimed twice."""
import dataclasses
import hashlib
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from runtime.inspect import cli
from runtime.inspect.examine import inspect_model
from runtime.model.findings.relations import relate
from runtime.model.graph.walk import find_tables_and_heads
from runtime.model.read import checked as read_checked
from runtime.model.read.model import load
from runtime.inspect.retie import rewrite, rules
from runtime.inspect.retie.write import retie
from runtime import feeds
from runtime.inspect.sandbox import agree, isolated, jobs
from runtime.feeds import feeds_for
from runtime.resident import prepacked_copies
from runtime.optimized import optimized_model
from tests.helpers import (
    BLOCK,
    FIXTURES,
    MADE,
    ROOT,
    VOCAB,
    WIDTH,
    U,
    findings,
    head_through,
    inspect_cli,
    inspected,
    model_in,
    one_line_error,
    refused,
    run_inspect,
    token_entry,
    transposed_head,
    unwrapped,
)

V, D = 300, 16


TABLE = np.random.default_rng(0).standard_normal((V, D)).astype(np.float32)


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def save(tmp_path, name, nodes, initializers, outputs=("logits",), ids_shape=("batch", "seq")):
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("ids", TensorProto.INT64, list(ids_shape))],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    return path


def shared_gemm(tmp_path, ids_shape=("batch", "seq")):
    """Gather and Gemm(transB=1) reading one initializer: tied on disk, but Gemm prepacks its constant B."""
    return save(tmp_path, "shared_gemm", [
        helper.make_node("Gather", ["table", "ids"], ["x"]), helper.make_node("Tanh", ["x"], ["h"]),
        helper.make_node("Reshape", ["h", "rows_shape"], ["rows"]),
        helper.make_node("Gemm", ["rows", "table"], ["logits"], transB=1)],
        {"table": TABLE, "rows_shape": np.array([-1, D], np.int64)}, ids_shape=ids_shape)


def onehot_duplicate(tmp_path):
    """A OneHot + MatMul lookup, and a Gemm head on a second copy of its table."""
    return save(tmp_path, "onehot_dup", [
        helper.make_node("OneHot", ["ids", "depth", "values"], ["one_hot"]),
        helper.make_node("MatMul", ["one_hot", "table"], ["x"]), helper.make_node("Tanh", ["x"], ["h"]),
        helper.make_node("Reshape", ["h", "rows_shape"], ["rows"]),
        helper.make_node("Gemm", ["rows", "head"], ["logits"], transB=1)],
        {"table": TABLE, "head": TABLE.copy(), "rows_shape": np.array([-1, D], np.int64),
         "depth": np.array([V], np.int64), "values": np.array([0, 1], np.float32)})


def logits_of(path, ids):
    return ort.InferenceSession(str(path)).run(["logits"], {"ids": ids})[0]


def expected_logits(ids):
    """tanh(table[ids]) @ table^T in float64, and float32's bound on a width-D dot product (gamma_D sum|a b|)."""
    h = np.tanh(TABLE[ids].astype(np.float32)).astype(np.float64).reshape(-1, D)
    t = TABLE.astype(np.float64)
    return h @ t.T, D * U / (1 - D * U) * (np.abs(h) @ np.abs(t).T)


def one_table_after_retie(source, out, ids):
    done = run_inspect(source, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    (entry,) = findings(out)["vocabulary"]
    assert entry["tables_in_memory"] == 1 and entry["in_memory"]["defaults"]["copies"] == 1
    exact, bound = expected_logits(ids)
    assert np.all(np.abs(logits_of(out, ids).reshape(exact.shape) - exact) <= 2 * bound)  # each side within one
    return done.stdout


# --- static shapes ----------------------------------------------------------------------------------------------------

def static(model, dims):
    """`model` with its symbolic input dims fixed (as an export without dynamic axes has them)."""
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_value = dims[dim.dim_param]
    return model


@pytest.mark.parametrize("fmt, block_size", [("float32", None), ("int4", 16)])
def test_lab_tied_head_holds_one_table_with_static_shapes(fmt, block_size, tmp_path):
    # failed on the main before issue 29: Shape(hidden) or Shape(ids) folded, the view became a second table
    model = static(graphs.tied_logits(graphs.make_table(V, 32), fmt=fmt, block_size=block_size),
                   {"batch": 2, "seq": 3})
    optimized = optimized_model(model, tmp_path)
    stored = {t.name: t for t in model.graph.initializer}
    grown = [t.name for t in optimized.graph.initializer if t.name not in stored and len(t.dims) >= 2]
    assert grown == []  # no folded copy of the table (float32) or of its scales' view (int4's lookup)
    packed = [p["initializer"] for p in prepacked_copies(optimized)]
    assert packed == ([] if fmt == "float32" else ["embedding"])  # MatMulNBits packs its codes: the int4 trade-off


def test_view_target_is_never_a_constant_whatever_the_anchor():
    """graphs.tie's view: its target equals the table's dims for anchors of any type and shape, empty and NaN too."""
    for dtype, values in ((TensorProto.FLOAT, np.array([[np.nan, 1]], np.float32)),
                          (TensorProto.FLOAT, np.zeros((0, 3), np.float32)),
                          (TensorProto.INT64, np.array([[-5]], np.int64)),
                          (TensorProto.FLOAT16, np.array([np.inf], np.float16))):
        nodes, constants, _ = graphs.tie.unfolded_view("t", "anchor", [4, 2], "view", "v_")
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("anchor", dtype, None)],
                                  [helper.make_tensor_value_info("view", TensorProto.FLOAT, [4, 2])],
                                  [numpy_helper.from_array(np.arange(8, dtype=np.float32).reshape(4, 2), "t")] +
                                  [numpy_helper.from_array(v, k) for k, v in constants.items()])
        session = ort.InferenceSession(helper.make_model(graph, opset_imports=[
            helper.make_opsetid("", 21)]).SerializeToString())
        (view,) = session.run(None, {"anchor": values})
        assert np.array_equal(view, np.arange(8, dtype=np.float32).reshape(4, 2)), (dtype, values)


# --- one rule for what is rewritten -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("ids_shape", [("batch", "seq"), (2, 5)])
def test_retie_a_shared_head_that_prepacks_its_table(ids_shape, tmp_path):
    # failed on the main before issue 29: "2 copies" measured, then "retie: nothing to do"
    source = shared_gemm(tmp_path, ids_shape)
    (entry,) = findings(source)["vocabulary"]
    assert (entry["tied"], entry["tables_in_memory"]) == (True, 2)
    stdout = one_table_after_retie(source, tmp_path / "out.onnx", np.arange(10).reshape(2, 5) * 29 % V)
    assert "nothing to do" not in stdout


@pytest.mark.slow
def test_retie_a_onehot_table_with_a_duplicated_head(tmp_path):
    # failed on the main before issue 29: "pair table / head: duplicate", then "retie: nothing to do"
    source = onehot_duplicate(tmp_path)
    (pair,) = findings(source)["pairs"]
    assert (pair["relation"], pair["wasted_bytes"]) == ("duplicate", V * D * 4)
    out = tmp_path / "out.onnx"
    one_table_after_retie(source, out, np.array([[0, 7, V - 1]]))
    assert [t.name for t in onnx.load(out).graph.initializer if len(t.dims) == 2] == ["table"]


def test_every_tie_left_as_it_is_is_said_and_nothing_else_is_rewritten():
    """remedy() is the one rule: a pair is rewritten, or left with a reason, or is no tie at all."""
    data = load(os.path.join(FIXTURES, "genai_fp16", "model.onnx"))
    pairs = relate(data, *find_tables_and_heads(data))
    for pair in pairs:
        how, why = rules.remedy(pair)
        assert not (how and why) and (pair.relation != "distinct" or (how, why) == (None, None))
    float16 = [p for p in pairs if p.relation != "distinct"]  # a float16 head on its float16 table: the view
    assert float16 and all(rules.remedy(p) == ("view", None) for p in float16)  # (test_retie_half.py proves it)
    for pair in float16:  # the same head in float32: another format than the table's, left and said
        pair = dataclasses.replace(pair, head_entry=dataclasses.replace(pair.head_entry, format="float32"))
        how, why = rules.remedy(pair)
        assert how is None and "with a head of the same format" in why


def test_retie_leaves_a_quantized_copy_and_says_why(tmp_path):
    done = run_inspect(os.path.join(FIXTURES, "ortquant_gather", "tinylm.onnx"), "--retie", tmp_path / "out.onnx")
    said = " ".join(unwrapped(done.stdout))
    assert done.returncode == 0 and "a quantized copy, not a tie" in said and "nothing to do" in said
    assert not os.listdir(tmp_path)


def test_retie_nothing_to_do_writes_nothing(exported, tmp_path):
    done = run_inspect(exported / "untied_logits.onnx", "--retie", tmp_path / "r.onnx")
    assert done.returncode == 0 and "nothing to do" in done.stdout
    assert not os.listdir(tmp_path)


# --- real exports -----------------------------------------------------------------------------------------------------

def head_input(model):
    """The hidden vector the last MatMul reads (the head in these fixtures)."""
    return [n for n in model.graph.node if n.op_type == "MatMul"][-1].input[0]


@pytest.mark.parametrize("name", ["torchscript_tied", "dynamo_tied_static"] + [  # one of each exporter in the fast loop
    pytest.param(n, marks=pytest.mark.slow) for n in ("dynamo_tied", "dynamo_tied_large", "torchscript_tied_static",
                                                      "dynamo_tied_large_static")])
def test_retie_torch_exports(name, tmp_path):
    # the static-shape ones (ids [2, 5]) failed before issue 29: the view's Shape(hidden) folded into a second table
    source = os.path.join(FIXTURES, name + ".onnx")
    before_hash = sha(source)
    out = tmp_path / "retied.onnx"
    done = run_inspect(source, "--retie", out)
    assert done.returncode == 0, done.stderr
    assert sha(source) == before_hash  # the input is never touched
    data = findings(out)
    tables = [p for p in data["pairs"] if p["relation"] != "distinct"]
    assert [(p["relation"], p["wasted_bytes"]) for p in tables] == [("shared", 0)]
    table_name = tables[0]["table"]
    assert not [c for c in data["runtime_copies"] if c.get("copy_of") == table_name]
    assert [v["tables_in_memory"] for v in data["vocabulary"]] == [1]

    # Independently: the original's hidden vector, then each model's logits against hidden @ table^T.
    original = onnx.load(source)
    hidden_name = head_input(original)
    original.graph.output.append(helper.make_empty_tensor_value_info(hidden_name))
    table = numpy_helper.to_array([t for t in original.graph.initializer if t.name == table_name][0])
    dims = [d.dim_value or n for d, n in zip(original.graph.input[0].type.tensor_type.shape.dim, (2, 7))]  # static
    ids = np.random.default_rng(1).integers(0, table.shape[0], size=dims)
    logits_before, hidden = ort.InferenceSession(original.SerializeToString()).run(["logits", hidden_name],
                                                                                    {"ids": ids})
    (logits_after,) = ort.InferenceSession(str(out)).run(["logits"], {"ids": ids})
    h, t = hidden.astype(np.float64), table.astype(np.float64)
    exact = h @ t.T
    width = table.shape[1]
    bound = width * U / (1 - width * U) * (np.abs(h) @ np.abs(t).T)
    assert np.all(np.abs(logits_before - exact) <= bound)
    assert np.all(np.abs(logits_after - exact) <= bound)


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
    inspected(source, "--retie", out)
    (entry,) = findings(out)["vocabulary"]
    assert (entry["tables_in_memory"], entry["tied"], entry["vocab_size"], entry["width"]) == (1, True, VOCAB, WIDTH)
    logits_against_exact(source, out, "lm_head.MatMul.weight", lambda w: w.T, {"input_ids": VOCAB}, head_size=16)


@pytest.mark.slow
def test_retie_genai_int4_gathers_the_packed_codes_in_place(tmp_path):
    source = os.path.join(FIXTURES, "genai_int4", "model.onnx")
    out = tmp_path / "retied.onnx"
    inspected(source, "--retie", out)
    (entry,) = findings(out)["vocabulary"]
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


@pytest.mark.slow
def test_retie_optimum_gpt2_keeps_one_table(tmp_path):
    source = model_in("optimum_gpt2")
    (pair,) = [p for p in findings(source)["pairs"] if p["relation"] != "distinct"]  # test_findings.py says which
    out = tmp_path / "retied.onnx"  # the proof feeds past_key_values, attention_mask and position_ids consistently
    inspected(source, "--retie", out)
    wte = {v["table"]: v for v in findings(out)["vocabulary"]}["transformer.wte.weight"]
    assert (wte["tied"], wte["head"], wte["tables_in_memory"]) == (True, "transformer.wte.weight", 1)
    logits_against_exact(source, out, pair["head"], lambda w: w.T, {"input_ids": VOCAB}, head_size=None)


@pytest.mark.slow
def test_retie_optimum_without_kv_cache(tmp_path):
    source = os.path.join(FIXTURES, "optimum_gpt2_nokv", "model.onnx")
    assert not [i for i in onnx.load(source).graph.input if "past" in i.name]
    (pair,) = [p for p in findings(source)["pairs"] if p["relation"] != "distinct"]
    assert pair["relation"] == "transposed_duplicate"
    out = tmp_path / "retied.onnx"
    inspected(source, "--retie", out)
    wte = {v["table"]: v for v in findings(out)["vocabulary"]}["transformer.wte.weight"]
    assert (wte["tied"], wte["tables_in_memory"]) == (True, 1)
    logits_against_exact(source, out, pair["head"], lambda w: w.T, {"input_ids": VOCAB}, head_size=None)


@pytest.mark.slow
def test_gemma2_soft_capped_head_is_retied_and_proven(tmp_path):
    source = os.path.join(FIXTURES, "genai_gemma2_fp32", "model.onnx")
    out = tmp_path / "retied.onnx"
    inspected(source, "--retie", out)
    assert token_entry(findings(model_in("genai_gemma2_fp32")))["tables_in_memory"] == 2
    assert token_entry(findings(out))["tables_in_memory"] == 1
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


def test_a_model_that_cannot_run_is_never_blamed_on_the_retie(tmp_path):
    out = tmp_path / "retied.onnx"
    done = run_inspect(model_in("genai_gemma2_fp32"), "--retie", out, "--proof-past", "4")
    assert done.returncode == 2 and not out.exists()
    line = done.stderr.strip().splitlines()[-1]
    assert "cannot be proven on this machine" in line and "the original model" in line and "past 4" in line
    assert "Traceback" not in done.stderr
    bad = run_inspect(model_in("genai_gemma2_fp32"), "--proof-past", "-1")
    assert bad.returncode == 2 and "--proof-past" in bad.stderr


@pytest.mark.slow
def test_retie_a_padded_int4_export_stays_tied_and_holds_the_codes_once(tmp_path):
    config = MADE["genai_llama_int4_padded"]["config"]
    source = model_in("genai_llama_int4_padded")
    entry = token_entry(findings(source))
    out = tmp_path / "retied.onnx"
    inspected(source, "--retie", out)
    retied = token_entry(findings(out))
    assert (retied["width"], retied["tied"]) == (config["hidden_size"], True)
    # the export's folded Reshape held a second packed table; the retied model holds the codes once (prepacking
    # off: with it on, MatMulNBits' own packed copy is the second)
    assert entry["in_memory"]["no_prepacking"]["copies"] == 2 and retied["in_memory"]["no_prepacking"]["copies"] == 1
    every_output_bit_for_bit(source, out, seed=1)


def test_retie_one_int4_table_in_two_layouts_keeps_one(tmp_path):
    source = model_in("ortquant_nbits_folded")
    out = tmp_path / "retied.onnx"
    inspected(source, "--retie", out)
    retied = onnx.load(out)
    assert not [t for t in retied.graph.initializer if t.data_type == TensorProto.INT4]
    assert os.path.getsize(out) < os.path.getsize(source)
    every_output_bit_for_bit(source, out, seed=2)


def every_output_bit_for_bit(source, out, seed):
    """Every output of the two models agrees bit for bit on the same decoder inputs."""
    original = onnx.load(source)
    inputs = feeds_for(original, {"input_ids": VOCAB}, np.random.default_rng(seed), head_size=16)
    names = [o.name for o in original.graph.output]
    before = ort.InferenceSession(original.SerializeToString()).run(names, inputs)
    now = ort.InferenceSession(str(out)).run(names, inputs)
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(before, now))


def test_inputs_that_cannot_be_fed_mean_it_cannot_be_proven_here(tmp_path):
    model = transposed_head()
    model.graph.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, []))  # a scalar
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    code, _, err = inspect_cli(path, "--retie", tmp_path / "out.onnx")
    assert one_line_error(code, err, "cannot be proven on this machine", "no feeds can be made")
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.slow
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
            assert retie(info.model, info, out, folder, isolated.Limits(), lambda line: None) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < weight.nbytes / 3, f"{peak} bytes at the peak for a {weight.nbytes}-byte table"
    retied = onnx.load(out)
    (rows,) = [t for t in retied.graph.initializer if t.name != "W" and list(t.dims) == [vocab, width]]
    assert np.array_equal(numpy_helper.to_array(rows).view(np.uint32), weight.T.view(np.uint32))


@pytest.mark.slow
def test_a_retie_past_thousands_of_dead_nodes_is_quick(tmp_path):
    model = onnx.load(os.path.join(FIXTURES, "torchscript_tied.onnx"))
    previous = model.graph.input[0].name
    for i in range(8000):  # a chain nobody reads: every pass of a naive sweep removes one
        model.graph.node.append(helper.make_node("Identity", [previous], [f"dead{i}"]))
        previous = f"dead{i}"
    path, out = tmp_path / "dead.onnx", tmp_path / "retied.onnx"
    onnx.save(model, path)
    start = time.monotonic()
    code, _, err = inspect_cli(path, "--retie", out, timeout=300)
    assert code == 0 and out.exists(), err
    assert not [n for n in onnx.load(out).graph.node if n.output[0].startswith("dead")]
    assert time.monotonic() - start < 120  # a hang guard: seconds here, where every pass once took minutes


# --- a proof that fails -----------------------------------------------------------------------------------------------

def test_a_model_changed_during_the_proof_is_changed_not_refused(tmp_path):
    # failed on the main before issue 29: the child's second copy of isolated.Changed was caught as "error"
    source = shared_gemm(tmp_path)
    model = load(str(source))
    checked = model.checked
    with open(source, "ab") as f:
        f.write(b"\0")  # rewritten after the check
    job = jobs.prove(jobs.Proof(str(source), checked, str(source), [], {"ids": V}, {"lengths": [1]}), str(tmp_path))
    with pytest.raises(read_checked.Changed, match="changed after it was checked"):
        isolated.call(job, "proving the retied model", isolated.Limits(60), 1 << 20)


def tampered(monkeypatch, change):
    """Make retie's rewrite also apply `change(graph)` to the model it then proves."""
    real = rewrite.rewrite

    def rewritten(model, pairs, *flags):
        answer = real(model, pairs, *flags)
        change(model.proto.graph)
        return answer
    monkeypatch.setattr(rewrite, "rewrite", rewritten)


def retie_in_process(source, out, capsys):
    status = cli.main([str(source), "--retie", str(out)], supervised=False)
    return status, capsys.readouterr()


def with_embeddings_output(tmp_path):
    """onehot_duplicate's lookup rows as a second output: what the proof compares bit for bit."""
    model = onnx.load(onehot_duplicate(tmp_path))
    model.graph.output.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, None))
    path = tmp_path / "two_outputs.onnx"
    onnx.save(model, path)
    return path


def test_an_output_off_by_one_ulp_fails_the_proof_and_writes_nothing(tmp_path, monkeypatch, capsys):
    def one_ulp(graph):  # the lookup's rows times the float32 after 1: each value moves by one ulp or two
        (node,) = [n for n in graph.node if "x" in n.output]
        node.output[0] = "x_exact"
        graph.initializer.append(numpy_helper.from_array(np.array(1 + 2.0**-23, np.float32), "next_after_one"))
        graph.node.insert(list(graph.node).index(node) + 1, helper.make_node("Mul", ["x_exact", "next_after_one"], ["x"]))
    tampered(monkeypatch, one_ulp)
    out = tmp_path / "out" / "retied.onnx"
    out.parent.mkdir()
    status, printed = retie_in_process(with_embeddings_output(tmp_path), out, capsys)
    said = " ".join(unwrapped(printed.out))  # however the feeds' label wraps it
    assert status == 1 and "not proven, nothing written" in said and "output 'x': not bit-identical" in said
    assert os.listdir(out.parent) == []


def test_a_rewrite_pointed_at_a_slightly_wrong_table_fails_the_proof(tmp_path, monkeypatch, capsys):
    def wrong_table(graph):  # the head's view reads a copy with one value a thousandth off
        off = TABLE.copy()
        off[7, 3] *= 1.001
        graph.initializer.append(numpy_helper.from_array(off, "almost_the_table"))
        (gemm,) = [n for n in graph.node if n.op_type == "Gemm"]
        (view,) = [n for n in graph.node if gemm.input[1] in n.output]
        assert (view.op_type, view.input[0]) == ("Reshape", "table")
        view.input[0] = "almost_the_table"
    tampered(monkeypatch, wrong_table)
    out = tmp_path / "out" / "retied.onnx"
    out.parent.mkdir()
    status, printed = retie_in_process(onehot_duplicate(tmp_path), out, capsys)
    assert status == 1 and "output 'logits': differs beyond float32's rounding bound on its dot products" in " ".join(
        unwrapped(printed.out))
    assert os.listdir(out.parent) == []


def test_a_head_output_just_past_its_bound_fails_and_just_within_passes():
    rng = np.random.default_rng(5)
    hidden, table = rng.standard_normal((3, D)).astype(np.float32), TABLE
    h, t = hidden.astype(np.float64), table.astype(np.float64)
    exact = (h @ t.T).astype(np.float32)
    bound = 2 * D * U / (1 - D * U) * (np.abs(h) @ np.abs(t).T)  # the proof's: 2 gamma_w sum|h t|, computed here
    head_of, chains, tables = {"logits": ("hidden", "table")}, {"logits": [("logits", 1.0, 0)]}, {"table": table}
    at = np.unravel_index(np.argmax(bound / (np.abs(exact) + 1e-30)), exact.shape)  # rounding there: far below it
    for factor, fails in ((1.02, True), (0.98, False)):
        moved = exact.astype(np.float64)
        moved[at] += factor * bound[at]
        old = {"logits": exact, "hidden": hidden}
        new = {"logits": moved.astype(np.float32), "hidden": hidden}
        assert abs(float(new["logits"][at]) - moved[at]) < 0.01 * bound[at]
        failures = agree.compare(old, new, head_of, chains, tables)
        assert bool(failures) == fails, (factor, failures)


def test_retie_proves_a_head_whose_logits_get_a_constant_bias(tmp_path):
    # failed before (Marian 58101 x 512: "output 'logits': not bit-identical"): only scalar constants were followed
    bias = np.random.default_rng(4).standard_normal((1, V)).astype(np.float32) * 100  # large: rounding shows
    source = save(tmp_path, "biased", [
        helper.make_node("Gather", ["table", "ids"], ["x"]), helper.make_node("Tanh", ["x"], ["h"]),
        helper.make_node("Reshape", ["h", "rows_shape"], ["rows"]),
        helper.make_node("Gemm", ["rows", "head"], ["scores"], transB=1),
        helper.make_node("Add", ["scores", "final_logits_bias"], ["logits"])],
        {"table": TABLE, "head": TABLE.copy(), "rows_shape": np.array([-1, D], np.int64), "final_logits_bias": bias})
    out = tmp_path / "out.onnx"
    done = run_inspect(source, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    ids = np.arange(6).reshape(2, 3) * 41 % V
    exact, bound = expected_logits(ids)
    got = logits_of(out, ids).reshape(exact.shape).astype(np.float64) - bias.astype(np.float64)
    assert np.all(np.abs(got - exact) <= 2 * bound + 2 * 2.0**-24 * (np.abs(exact) + np.abs(bias)))


# --- writing OUT ------------------------------------------------------------------------------------------------------

def test_retie_refuses_to_overwrite(tmp_path):
    source = tmp_path / "m.onnx"
    source.write_bytes(open(os.path.join(FIXTURES, "torchscript_tied.onnx"), "rb").read())
    before = sha(source)
    assert refused(run_inspect(source, "--retie", source))
    assert refused(run_inspect(source, "--retie", tmp_path / "." / "m.onnx"))
    existing = tmp_path / "existing.onnx"
    existing.write_text("mine")
    assert refused(run_inspect(source, "--retie", existing))
    assert existing.read_text() == "mine" and sha(source) == before
    assert sorted(os.listdir(tmp_path)) == ["existing.onnx", "m.onnx"]


def test_out_that_appears_while_writing_is_never_replaced(tmp_path, monkeypatch):
    out = tmp_path / "out.onnx"
    out.write_bytes(b"someone else's model")
    model = graphs.tied_logits(graphs.make_table(16, 8))
    monkeypatch.setattr(graphs.storage.os.path, "lexists", lambda p: False)  # the up-front check is passed...
    with pytest.raises(FileExistsError, match="appeared while writing"):  # ...and the other writer got there first
        graphs.save(model, out, external=True)
    monkeypatch.undo()
    assert out.read_bytes() == b"someone else's model"
    assert not os.path.exists(graphs.storage.data_path(out))  # the data this call placed was taken back
    assert sorted(os.listdir(tmp_path)) == ["out.onnx"]


@pytest.mark.slow
def test_two_reties_to_one_out_never_both_claim_it(tmp_path):
    tables = {name: graphs.make_table(16, 4, seed) for seed, name in enumerate("ab")}
    for name, table in tables.items():  # heads through a Transpose: --retie has something to write
        onnx.save(head_through([helper.make_node("Transpose", ["embedding"], ["t"], perm=[1, 0])], table),
                  tmp_path / f"{name}.onnx")
    for round_ in range(3):
        out = tmp_path / f"out{round_}.onnx"
        runs = {name: subprocess.Popen([sys.executable, "-m", "runtime.inspect", str(tmp_path / f"{name}.onnx"),
                                        "--retie", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True) for name in tables}
        answers = {name: (run.wait(timeout=300), *run.communicate()) for name, run in runs.items()}
        winners = [name for name, (code, stdout, _) in answers.items() if code == 0 and f"wrote {out}" in stdout]
        losers = [name for name, (code, _, err) in answers.items()
                  if code == 2 and ("exists" in err or "appeared" in err)]
        assert len(winners) == 1 and len(losers) == 1, answers
        table = numpy_helper.to_array(next(t for t in onnx.load(out).graph.initializer if t.name == "embedding"))
        assert table.tobytes() == tables[winners[0]].tobytes()  # OUT holds the winner's model, whole
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".saving-")]


def test_a_sidecar_that_cannot_be_written_leaves_out_whole(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(os.path.join(FIXTURES, "torchscript_tied.onnx"), folder / "model.onnx")
    (folder / "tokenizer.json").write_bytes(b"{" + b" " * (10 << 20) + b"}")  # 10 MiB: past the file-size limit
    limit = 5 << 20

    def shell_limit():  # `ulimit -f` in the user's shell: OUT (40 KB) fits, the tokenizer does not
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    code, stdout, err = inspect_cli(folder / "model.onnx", "--retie", out, preexec_fn=shell_limit)
    assert code == 0 and "tokenizer.json not copied beside OUT: File too large" in stdout, (stdout, err)
    onnx.checker.check_model(str(out))
    assert sorted(os.listdir(out.parent)) == ["model.onnx"]


def test_a_fifo_or_folder_sidecar_does_not_block_retie(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(os.path.join(FIXTURES, "genai_fp32"), folder)
    os.remove(folder / "genai_config.json")
    os.mkfifo(folder / "genai_config.json")
    (folder / "generation_config.json").mkdir()  # a folder where a file is looked for: skipped, not an error
    start = time.monotonic()
    code, out, err = inspect_cli(folder / "model.onnx", "--retie", tmp_path / "out" / "model.onnx", timeout=300)
    assert code == 2 and "no such folder" in err  # OUT's folder is checked first
    (tmp_path / "out").mkdir()
    code, out, err = inspect_cli(folder / "model.onnx", "--retie", tmp_path / "out" / "model.onnx", timeout=300)
    assert code == 0 and "Traceback" not in err, err
    assert time.monotonic() - start < 240
    copied = os.listdir(tmp_path / "out")
    assert "genai_config.json" not in copied and "generation_config.json" not in copied  # not files to copy
