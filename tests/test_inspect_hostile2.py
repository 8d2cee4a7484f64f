"""runtime.inspect on hostile input, round two: names that write to the terminal, attributes of the wrong type,
model files that are sparse or too large, a race for OUT, and signals. Every answer is a report or one line on
stderr, never a traceback, and nothing is left behind."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from tests.helpers import FIXTURES, ROOT, inspect_cli, model_of, one_line_error

HOSTILE = "emb\x1b]0;pwned\x07\x1b[2J\nvocabulary: forged\u2028x"


def renamed(model, old, new):
    for tensor in model.graph.initializer:
        if tensor.name == old:
            tensor.name = new
    for node in model.graph.node:
        node.input[:] = [new if x == old else x for x in node.input]
    return model


def test_names_cannot_write_to_the_terminal(tmp_path):
    path = tmp_path / "esc.onnx"
    onnx.save(renamed(graphs.tied_logits(graphs.make_table(16, 8)), "embedding", HOSTILE), path)
    code, out, err = inspect_cli(path)
    assert code == 0, err
    assert not any(c in out for c in "\x1b\x07\u2028") and "\\x1b]0;pwned\\x07" in out
    assert not any(line.startswith("vocabulary: forged") for line in out.splitlines())
    done = subprocess.run([sys.executable, "-m", "runtime.inspect", str(path)], cwd=ROOT, capture_output=True,
                          env=dict(os.environ, PYTHONIOENCODING="ascii"), timeout=120)
    assert done.returncode == 0 and b"Traceback" not in done.stderr  # U+2028 on an ASCII terminal: escaped


def test_a_name_that_is_not_utf8_is_refused(tmp_path):
    model = renamed(graphs.tied_logits(graphs.make_table(16, 8)), "embedding", "EMBXQ")
    path = tmp_path / "bad.onnx"
    path.write_bytes(model.SerializeToString().replace(b"EMBXQ", b"E\xff\xfeXQ"))
    for args in ((path,), (path, "--json")):
        code, _, err = inspect_cli(*args)
        assert one_line_error(code, err, "not valid UTF-8"), err


def gemm_head(trans_b):
    table = graphs.make_table(16, 4)
    gemm = helper.make_node("Gemm", ["hidden", "embedding"], ["logits"])
    gemm.attribute.append(trans_b)
    return model_of([helper.make_node("Gather", ["embedding", "ids"], ["embeddings"]), gemm],
                    [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                     helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", 4])],
                    [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["n", 4]),
                     helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 16])],
                    [numpy_helper.from_array(table, "embedding")])


@pytest.mark.parametrize("attribute", [
    helper.make_attribute("transB", "1"),  # a string
    onnx.AttributeProto(name="transB"),  # no type
    helper.make_attribute_ref("transB", onnx.AttributeProto.INT),  # a reference
], ids=["string", "untyped", "reference"])
def test_an_attribute_of_the_wrong_type_is_a_finding(tmp_path, attribute):
    path = tmp_path / "gemm.onnx"
    onnx.save(gemm_head(attribute), path)
    code, _, err = inspect_cli(path)
    assert one_line_error(code, err, "transB", "not an INT"), err


def test_matmulnbits_without_n_is_a_finding(tmp_path):
    codes = np.zeros((16, 1, 16), np.uint8)
    node = helper.make_node("MatMulNBits", ["hidden", "w", "s"], ["logits"], domain="com.microsoft", K=32, bits=4,
                            block_size=32)
    model = model_of([node], [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", 32])],
                     [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 16])],
                     [numpy_helper.from_array(codes, "w"), numpy_helper.from_array(np.ones((16, 1), np.float32), "s")])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    path = tmp_path / "nbits.onnx"
    onnx.save(model, path)
    code, _, err = inspect_cli(path)
    assert one_line_error(code, err, "MatMulNBits", "N and K"), err


def test_a_sparse_or_oversized_model_file_is_refused_unread(tmp_path):
    path = tmp_path / "sparse.onnx"
    onnx.save(graphs.tied_logits(graphs.make_table(16, 8)), path)
    with open(path, "r+b") as f:
        f.truncate(2**30)  # a hole: a few KiB on disk, 1 GiB long
    start = time.monotonic()
    code, _, err = inspect_cli(path)
    assert one_line_error(code, err, "sparse file") and time.monotonic() - start < 30, err
    with open(path, "r+b") as f:
        f.truncate(3 * 2**30)
    code, _, err = inspect_cli(path)
    assert one_line_error(code, err, "more than a protobuf holds"), err


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


@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_signal_leaves_nothing_behind(tmp_path, sig, code, word):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "retied.onnx"
    process = subprocess.Popen([sys.executable, "-m", "runtime.inspect",
                                os.path.join(FIXTURES, "genai_fp32", "model.onnx"), "--retie", str(out)], cwd=ROOT,
                               env=dict(os.environ, TMPDIR=str(scratch)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))  # a background job (CI)
                               # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    deadline = time.monotonic() + 60
    while not [n for n in os.listdir(scratch) if n.startswith("onnx-lab-")] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    process.send_signal(sig)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == code and word in err and "Traceback" not in err, err
    # onnxruntime itself leaves files there on any run (1.32: .ses, a session id; 1.30: mat-debug-PID.log): what
    # must go is the tool's own scratch folder
    assert not [n for n in os.listdir(scratch) if n.startswith(("onnx-lab-", "tmp"))] and not out.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".saving-")]
    children = subprocess.run(["pgrep", "-f", str(scratch)], capture_output=True, text=True).stdout
    assert children == ""  # no isolated child outlives the tool


def many_tables(count):
    """`count` lookups and `count` heads, all of one shape and all different: count^2 pairs to relate."""
    rng = np.random.default_rng(0)
    nodes, initializers, outputs = [], [], []
    for i in range(count):
        initializers += [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), f"t{i}"),
                         numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), f"h{i}")]
        nodes += [helper.make_node("Gather", [f"t{i}", "ids"], [f"e{i}"]),
                  helper.make_node("MatMul", ["hidden", f"h{i}"], [f"l{i}"])]
        outputs += [helper.make_tensor_value_info(f"e{i}", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info(f"l{i}", TensorProto.FLOAT, None)]
    return model_of(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", 4])],
                    outputs, initializers)


def test_many_tables_and_heads_take_seconds_not_minutes(tmp_path):
    path = tmp_path / "many.onnx"
    onnx.save(many_tables(400), path)
    start = time.monotonic()
    code, out, err = inspect_cli(path, timeout=300)
    assert code == 0, err
    assert "160000 table/head pairs of matching shape are distinct" in out
    assert time.monotonic() - start < 120  # a hang guard for a shared machine: it takes about 5 s here


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


def test_tensors_inside_function_bodies_are_checked(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "outside.bin").write_bytes(np.ones(4, np.float32).tobytes())
    tensor = onnx.TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "../outside.bin"), ("offset", "0"), ("length", "16")):
        tensor.external_data.add(key=key, value=value)
    function = helper.make_function("lab.hostile", "AddC", ["x"], ["y"],
                                    [helper.make_node("Constant", [], ["c"], value=tensor),
                                     helper.make_node("Add", ["x", "c"], ["y"])],
                                    [helper.make_opsetid("", 21)])
    model = model_of([helper.make_node("AddC", ["x"], ["y"], domain="lab.hostile")],
                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [])
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("lab.hostile", 1))
    path = tmp_path / "model" / "model.onnx"
    path.write_bytes(model.SerializeToString())
    code, _, err = inspect_cli(path)
    assert one_line_error(code, err, "escapes the model's folder"), err


def test_a_path_through_a_link_is_checked_where_the_os_finds_it(tmp_path):
    real, elsewhere = tmp_path / "real", tmp_path / "elsewhere"
    (real / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    os.symlink(real / "sub", elsewhere / "link")
    graphs.save(graphs.tied_logits(graphs.make_table(64, 8)), real / "model.onnx", external=True)  # data beside it
    onnx.save(graphs.tied_logits(graphs.make_table(16, 8)), elsewhere / "model.onnx")  # a decoy where a lexical
    assert os.path.getsize(real / "model.onnx.data") >= 2048                           # reading of link/.. looks
    code, out, err = inspect_cli(elsewhere / "link" / ".." / "model.onnx")  # the OS opens real/model.onnx
    assert code == 0, err
    assert "external" not in err and "embedding" in out
    data = json.loads(inspect_cli(elsewhere / "link" / ".." / "model.onnx", "--json")[1])
    assert data["file_bytes"] == sum(os.path.getsize(real / f) for f in ("model.onnx", "model.onnx.data"))
