"""What --retie rewrites and proves (issue 29): static shapes, a head sharing its table that still prepacks it, a
OneHot product's table, two quantizations of one table, the child's own entry module, and a proof that fails."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from runtime.inspect import cli
from runtime.inspect.findings.relations import relate
from runtime.inspect.graph.walk import find_tables_and_heads
from runtime.inspect.read import checked as read_checked
from runtime.inspect.read.model import load
from runtime.inspect.retie import rewrite, rules
from runtime.inspect.sandbox import isolated, proof
from runtime.resident import prepacked_copies
from runtime.runner import optimized_model
from tests.helpers import FIXTURES, ROOT, U

V, D = 300, 16
TABLE = np.random.default_rng(0).standard_normal((V, D)).astype(np.float32)


def run_inspect(*args):
    return subprocess.run([sys.executable, "-m", "runtime.inspect", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def findings(path):
    done = run_inspect(path, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


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


# --- 1. static shapes ---------------------------------------------------------------------------------------

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


# --- 2. and 3. one rule for what is rewritten ------------------------------------------------------------------

@pytest.mark.parametrize("ids_shape", [("batch", "seq"), (2, 5)])
def test_retie_a_shared_head_that_prepacks_its_table(ids_shape, tmp_path):
    # failed on the main before issue 29: "2 copies" measured, then "retie: nothing to do"
    source = shared_gemm(tmp_path, ids_shape)
    (entry,) = findings(source)["vocabulary"]
    assert (entry["tied"], entry["tables_in_memory"]) == (True, 2)
    stdout = one_table_after_retie(source, tmp_path / "out.onnx", np.arange(10).reshape(2, 5) * 29 % V)
    assert "nothing to do" not in stdout


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
        assert not (how and why) and (pair["relation"] != "distinct" or (how, why) == (None, None))
    float16 = [p for p in pairs if p["relation"] != "distinct"]
    assert float16 and all(rules.remedy(p)[0] is None and "float16" in rules.remedy(p)[1] for p in float16)


# --- 4. two quantizations of one table --------------------------------------------------------------------------

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


def test_retie_leaves_a_quantized_copy_and_says_why(tmp_path):
    done = run_inspect(os.path.join(FIXTURES, "ortquant_gather", "tinylm.onnx"), "--retie", tmp_path / "out.onnx")
    assert done.returncode == 0 and "a quantized copy, not a tie" in done.stdout and "nothing to do" in done.stdout
    assert not os.listdir(tmp_path)


# --- 5. the child, and a proof that fails ------------------------------------------------------------------------

def test_the_child_has_its_own_entry_module_and_the_package_imports_nothing():
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import runtime.inspect.sandbox.child"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "runtime.inspect.sandbox.child" in imported
    assert not imported & {"runtime.inspect.cli", "runtime.inspect.retie.write", "onnxruntime"}
    # the reader: neither onnxruntime nor the command line (the package's face is lazy)
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import runtime.inspect.read.model"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "runtime.inspect.read.model" in imported
    assert not imported & {"runtime.inspect.cli", "runtime.inspect.sandbox.isolated", "onnxruntime"}
    done = subprocess.run([sys.executable, "-W", "error", "-m", "runtime.inspect.sandbox.child", "/nonexistent/job.json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "RuntimeWarning" not in done.stderr and "FileNotFoundError" in done.stderr


def test_a_model_changed_during_the_proof_is_changed_not_refused(tmp_path):
    # failed on the main before issue 29: the child's second copy of isolated.Changed was caught as "error"
    source = shared_gemm(tmp_path)
    model = load(str(source))
    checked = model.checked
    with open(source, "ab") as f:
        f.write(b"\0")  # rewritten after the check
    job = {"kind": "prove", "before": str(source), "checked": checked, "after": str(source), "rewritten": [],
           "rows": {"ids": V}, "folder": str(tmp_path), "shape": {"lengths": [1]}}
    with pytest.raises(read_checked.Changed, match="changed after it was checked"):
        isolated.call(job, "proving the retied model", isolated.Limits(60), 1 << 20)


def tampered(monkeypatch, change):
    """Make retie's rewrite also apply `change(graph)` to the model it then proves."""
    real = rewrite.rewrite

    def rewritten(model, pairs):
        answer = real(model, pairs)
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
    assert status == 1 and "not proven, nothing written" in printed.out and "output 'x': not bit-identical" in printed.out
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
    assert status == 1 and "output 'logits': differs beyond 2 gamma_w sum|a b|" in printed.out
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
        failures = proof._compare(old, new, head_of, chains, tables)
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
