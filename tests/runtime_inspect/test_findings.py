"""runtime.inspect on the lab's own graphs, on real torch exports, and on hand-made duplicates and bad files."""
import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from graphs.export import FILES, build_all
from runtime import inspect
from tests.helpers import FIXTURES, ROOT, U



def run_inspect(*args):
    done = subprocess.run([sys.executable, "-m", "runtime.inspect", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return done


def findings(path):
    done = run_inspect(path, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def relations(data):
    return [(p["table"], p["head"], p["relation"], p["wasted_bytes"]) for p in data["pairs"]]


def folded(data):
    """The runtime copies onnxruntime's optimized model holds (not the ones kernels prepack at load)."""
    return [c for c in data["runtime_copies"] if c.get("view") != "prepacked"]


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# --- the lab's own graphs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lab")
    for name, model in build_all(64, 8, 0).items():
        graphs.save(model, folder / name)
    return folder


def test_inspect_own_graphs(exported):
    expected = {
        "gather_lookup.onnx": [], "onehot_lookup.onnx": [], "scaled_lookup.onnx": [],
        "tied_logits.onnx": [("embedding", "embedding", "shared", 0)],
        "untied_logits.onnx": [("embedding", "lm_head", "distinct", 0)],
        "neighbors_dot.onnx": [("embedding", "embedding", "shared", 0)],
        "neighbors_cosine.onnx": [("embedding", "embedding", "shared", 0)],
    }
    for name in FILES:
        data = findings(exported / name)
        assert relations(data) == expected[name], name
        assert data["file_bytes"] == os.path.getsize(exported / name)
        table = [i for i in data["initializers"] if i["name"] == "embedding"][0]
        assert (table["dtype"], table["shape"], table["elements"], table["bytes"]) == ("float32", [64, 8], 512, 2048)
        assert not [c for c in folded(data) if c["bytes"] >= 2048], name  # no table is copied
        # under onnxruntime's defaults too: only the untied head and the one-hot product's MatMul prepack what they
        # multiply by, and the original is then freed
        prepacked = [c["copy_of"] for c in data["runtime_copies"] if c.get("view") == "prepacked"]
        assert prepacked == {"untied_logits.onnx": ["lm_head"], "onehot_lookup.onnx": ["embedding"]}.get(name, []), name
        assert [v["tables_in_memory"] for v in data["vocabulary"]] == [1] * len(data["vocabulary"]), name


def test_inspect_reads_external_data_and_counts_its_bytes(tmp_path):
    path = tmp_path / "tied.onnx"
    graphs.save(graphs.tied_logits(graphs.make_table(64, 8)), path, external=True)
    data = findings(path)
    assert data["file_bytes"] == os.path.getsize(path) + os.path.getsize(str(path) + ".data")
    assert relations(data) == [("embedding", "embedding", "shared", 0)]


# --- real exporter output ------------------------------------------------------------------------------

TABLE_BYTES = 256 * 32 * 4


@pytest.mark.parametrize("name, table, relation, wasted", [
    ("torchscript_tied", "embed.weight", "transposed_duplicate", TABLE_BYTES),
    ("torchscript_untied", "embed.weight", "distinct", 0),
    ("dynamo_tied", "lm_head.weight", "transposed_duplicate", TABLE_BYTES),
    ("dynamo_untied", "embed.weight", "distinct", 0),
])
def test_inspect_torch_exports(name, table, relation, wasted):
    data = findings(os.path.join(FIXTURES, name + ".onnx"))
    pairs = [p for p in data["pairs"] if p["table"] == table]
    assert [(p["relation"], p["wasted_bytes"]) for p in pairs] == [(relation, wasted)]
    assert not [c for c in folded(data) if c["bytes"] >= TABLE_BYTES]


def test_inspect_dynamo_large_table_is_copied_at_run_time():
    data = findings(os.path.join(FIXTURES, "dynamo_tied_large.onnx"))
    assert relations(data) == [("lm_head.weight", "lm_head.weight", "shared", 0)]
    copies = [c for c in folded(data) if c.get("copy_of") == "lm_head.weight"]
    assert [(c["bytes"], c["transposed"], c["shape"]) for c in copies] == [(1024 * 64 * 4, True, [64, 1024])]


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


# --- retie ----------------------------------------------------------------------------------------------

def head_input(model):
    """The hidden vector the last MatMul reads (the head in these fixtures)."""
    return [n for n in model.graph.node if n.op_type == "MatMul"][-1].input[0]


@pytest.mark.parametrize("name", ["torchscript_tied", "dynamo_tied", "dynamo_tied_large", "torchscript_tied_static",
                                  "dynamo_tied_static", "dynamo_tied_large_static"])
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


def test_retie_reports_bytes_saved(tmp_path):
    done = run_inspect(os.path.join(FIXTURES, "torchscript_tied.onnx"), "--retie", tmp_path / "r.onnx")
    line = [l for l in done.stdout.splitlines() if l.startswith("retie: wrote")][0]
    saved = int(line.split("(saved ")[1].split(")")[0])
    # one table, less the tie's run-time view: five small nodes with their docs, and two shape constants
    assert TABLE_BYTES - 2048 <= saved <= TABLE_BYTES


def test_retie_nothing_to_do_writes_nothing(exported, tmp_path):
    done = run_inspect(exported / "untied_logits.onnx", "--retie", tmp_path / "r.onnx")
    assert done.returncode == 0 and "nothing to do" in done.stdout
    assert not os.listdir(tmp_path)


# --- bad input ------------------------------------------------------------------------------------------

def bad(done):
    return done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_bad_inputs_exit_2(tmp_path):
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(open(os.path.join(FIXTURES, "torchscript_tied.onnx"), "rb").read()[:5000])
    for path in (tmp_path / "missing.onnx", text, truncated, tmp_path):
        assert bad(run_inspect(path)), path
    assert sorted(os.listdir(tmp_path)) == ["notes.onnx", "truncated.onnx"]


def test_external_data_escaping_the_folder_is_refused(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.ones((4, 2), np.float32).tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    model = graphs.gather_lookup(np.ones((4, 2), np.float32))
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", "32")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    onnx.save(model, folder / "escape.onnx")
    done = run_inspect(folder / "escape.onnx")
    assert bad(done) and "escapes" in done.stderr
    tensor.external_data[0].value = str(secret)  # an absolute path, too
    onnx.save(model, folder / "absolute.onnx")
    assert bad(run_inspect(folder / "absolute.onnx"))


def test_retie_refuses_to_overwrite(tmp_path):
    source = tmp_path / "m.onnx"
    source.write_bytes(open(os.path.join(FIXTURES, "torchscript_tied.onnx"), "rb").read())
    before = sha(source)
    assert bad(run_inspect(source, "--retie", source))
    assert bad(run_inspect(source, "--retie", tmp_path / "." / "m.onnx"))
    existing = tmp_path / "existing.onnx"
    existing.write_text("mine")
    assert bad(run_inspect(source, "--retie", existing))
    assert existing.read_text() == "mine" and sha(source) == before
    assert sorted(os.listdir(tmp_path)) == ["existing.onnx", "m.onnx"]


def test_inspect_module_api_matches_cli(exported, tmp_path):
    info = inspect.inspect_model(str(exported / "tied_logits.onnx"), str(tmp_path))
    assert [t["initializer"] for t in info["tables"]] == ["embedding"]
    assert [h["initializer"] for h in info["heads"]] == ["embedding"]


@pytest.mark.parametrize("out, message", [("", "needs a file name for OUT"), ("{tmp}/newdir/", "a folder"),
                                          ("{tmp}", "a folder")])
def test_retie_refuses_a_bad_out_before_any_work(tmp_path, out, message):
    done = run_inspect(os.path.join(FIXTURES, "torchscript_tied.onnx"), "--retie", out.format(tmp=tmp_path))
    assert bad(done) and message in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flag, value", [("--timeout", "1e20"), ("--memory-limit", "1e300"), ("--timeout", "inf")])
def test_limits_that_would_overflow_are_refused(flag, value):
    done = run_inspect(os.path.join(FIXTURES, "torchscript_tied.onnx"), flag, value)
    assert bad(done) and "up to 1e+06" in done.stderr, done.stderr


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


def test_progress_shows_on_a_terminal_only(tmp_path):
    import pty
    path = os.path.join(FIXTURES, "genai_fp32", "model.onnx")
    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "runtime.inspect", path], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    out = process.communicate(timeout=300)[0]
    os.close(master)
    assert process.returncode == 0 and b"vocabulary:" in out
    assert b"\r[" in seen and b"building its optimized model" in seen and seen.endswith(b"\r")  # cleared at the end
    assert run_inspect(path).stderr == ""  # not a terminal: silent
