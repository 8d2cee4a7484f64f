"""Reading a model nobody vouched for (runtime.model.read): cycles, unknown types, external data that escapes,
is missing, sparse or short, malformed tensors, names that are not UTF-8, attributes of the wrong type, sidecars
beside the model; then a seeded structure-aware fuzzer. Every answer is a report or one line on stderr (exit 2),
never a traceback, quickly, and nothing is written beside the model but --retie's output."""
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from runtime.inspect import main
from runtime.model.graph import constants
from runtime.model.read.model import load
from runtime.model.read.text import InspectError
from tests.helpers import (
    FIXTURES,
    findings,
    head_through,
    inspect_cli,
    model_of,
    one_line_error,
    refused,
    relations,
    renamed,
    run_inspect,
    save_raw,
    transposed_head,
)


# --- files that are not models ----------------------------------------------------------------------------------------

def test_bad_inputs_exit_2(tmp_path):
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(open(os.path.join(FIXTURES, "torchscript_tied.onnx"), "rb").read()[:5000])
    for path in (tmp_path / "missing.onnx", text, truncated, tmp_path):
        assert refused(run_inspect(path)), path
    assert sorted(os.listdir(tmp_path)) == ["notes.onnx", "truncated.onnx"]


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


# --- graphs that are not valid ----------------------------------------------------------------------------------------

def test_identity_cycle_is_a_finding(tmp_path):
    nodes = [helper.make_node("Identity", ["b"], ["a"], name="a"), helper.make_node("Identity", ["a"], ["b"], name="b")]
    start = time.monotonic()
    code, _, err = inspect_cli(save_raw(head_through(nodes), tmp_path / "cycle.onnx"), timeout=30)
    assert one_line_error(code, err, "Identity cycle through", "a", "b", "not a valid ONNX graph")
    assert time.monotonic() - start < 30


def test_transpose_reading_its_own_output_is_a_finding(tmp_path):
    nodes = [helper.make_node("Transpose", ["self"], ["self"], name="loop", perm=[1, 0])]
    code, _, err = inspect_cli(save_raw(head_through(nodes), tmp_path / "self.onnx"), timeout=30)
    assert one_line_error(code, err, "Transpose cycle through loop")


def test_cycle_also_stops_retie(tmp_path):
    nodes = [helper.make_node("Identity", ["y"], ["x"], name="x"), helper.make_node("Transpose", ["x"], ["y"], name="y")]
    path = save_raw(head_through(nodes), tmp_path / "mixed.onnx")
    code, _, err = inspect_cli(path, "--retie", tmp_path / "out.onnx", timeout=30)
    assert one_line_error(code, err, "cycle of Identity, Transpose nodes through")
    assert sorted(os.listdir(tmp_path)) == ["mixed.onnx"]


def test_unknown_data_type_is_a_finding(tmp_path):
    model = head_through([])
    model.graph.initializer[0].data_type = 9999
    code, _, err = inspect_cli(save_raw(model, tmp_path / "type.onnx"))
    assert one_line_error(code, err, "'embedding'", "9999", "unknown or unsupported")


@pytest.mark.parametrize("case, change, words", [
    ("negative_dim", lambda t: t.dims.__setitem__(0, -16), ["negative dimension"]),
    ("short_raw", lambda t: setattr(t, "raw_data", t.raw_data[:-1]), ["raw data holds 255 bytes", "need 256"]),
    ("dims_too_big", lambda t: t.dims.__setitem__(0, 2**40), ["need"]),
    ("no_data", lambda t: t.ClearField("raw_data"), ["no data"]),
    ("huge_product", lambda t: t.dims.extend([2**40, 2**40]), ["more elements than any file holds"]),
    ("undefined_type", lambda t: setattr(t, "data_type", 0), ["UNDEFINED"]),
])
def test_malformed_tensor_is_one_line(tmp_path, case, change, words):
    model = head_through([])
    change(model.graph.initializer[0])
    code, _, err = inspect_cli(save_raw(model, tmp_path / f"{case}.onnx"))
    assert one_line_error(code, err, "'embedding'", *words), err


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


@pytest.mark.parametrize("dims", [(0, 8), (64, 0), (0, 0)])
def test_an_empty_table_is_reported_not_a_traceback(tmp_path, dims):
    table = np.zeros(dims, np.float32)
    path = tmp_path / "empty.onnx"
    model = model_of([helper.make_node("Gather", ["embedding", "ids"], ["e"]),
                      helper.make_node("Transpose", ["embedding"], ["t"], perm=[1, 0]),
                      helper.make_node("MatMul", ["hidden", "t"], ["logits"])],
                     [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                      helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", dims[1]])],
                     [helper.make_tensor_value_info("e", TensorProto.FLOAT, None),
                      helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                     [numpy_helper.from_array(table, "embedding")])
    onnx.save(model, path)
    code, out, err = inspect_cli(path)
    assert code == 0 and "vocabulary: no table" in out and "Traceback" not in err, err


# --- names ------------------------------------------------------------------------------------------------------------

def test_a_name_that_is_not_utf8_is_refused(tmp_path):
    model = renamed(graphs.tied_logits(graphs.make_table(16, 8)), "embedding", "EMBXQ")
    path = tmp_path / "bad.onnx"
    path.write_bytes(model.SerializeToString().replace(b"EMBXQ", b"E\xff\xfeXQ"))
    for args in ((path,), (path, "--json")):
        code, _, err = inspect_cli(*args)
        assert one_line_error(code, err, "not valid UTF-8"), err


def test_a_name_that_is_not_utf8_inside_a_subgraph_is_refused(tmp_path):
    branch = helper.make_graph([helper.make_node("Identity", ["embedding"], ["b"], name="NAMEMARK")], "then", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    model = transposed_head()
    model.graph.input.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    model.graph.node.append(helper.make_node("If", ["flag"], ["picked"], then_branch=branch, else_branch=branch))
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString().replace(b"NAMEMARK", b"\xff\xfe\x1b[2J\x07\xfc"))  # same length
    code, _, err = inspect_cli(path)
    assert one_line_error(code, err, "not valid UTF-8") and "\x1b" not in err


# --- external data ----------------------------------------------------------------------------------------------------

def test_inspect_reads_external_data_and_counts_its_bytes(tmp_path):
    path = tmp_path / "tied.onnx"
    graphs.save(graphs.tied_logits(graphs.make_table(64, 8)), path, external=True)
    data = findings(path)
    assert data["file_bytes"] == os.path.getsize(path) + os.path.getsize(str(path) + ".data")
    assert relations(data) == [("embedding", "embedding", "shared", 0)]


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
    assert refused(done) and "escapes" in done.stderr
    tensor.external_data[0].value = str(secret)  # an absolute path, too
    onnx.save(model, folder / "absolute.onnx")
    assert refused(run_inspect(folder / "absolute.onnx"))


def external(model, location, offset="0", length=None):
    """Point the model's first initializer at external data."""
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    entries = [("location", location), ("offset", offset)] + ([("length", length)] if length is not None else [])
    for key, value in entries:
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return model


def test_external_location_with_nul_byte_is_a_finding(tmp_path):
    code, _, err = inspect_cli(save_raw(external(head_through([]), "data\x00.bin"), tmp_path / "nul.onnx"))
    assert one_line_error(code, err, "odd characters")


def test_huge_tensor_over_a_sparse_file_is_refused(tmp_path):
    table = tmp_path / "table.bin"
    with open(table, "wb") as f:
        f.truncate(2**32)  # 4 GiB that are holes: reading it whole is what used to exhaust the machine
    model = external(head_through([]), "table.bin", length=str(2**32))
    del model.graph.initializer[0].dims[:]
    model.graph.initializer[0].dims.extend([2**20, 1024])
    start = time.monotonic()
    code, _, err = inspect_cli(save_raw(model, tmp_path / "sparse.onnx"), timeout=60)
    assert one_line_error(code, err, "sparse file; refused")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("case, location, offset, length, words", [
    ("escapes", "../outside.bin", "0", None, ["escapes the model's folder"]),
    ("absolute", "/etc/hostname", "0", None, ["not relative"]),
    ("missing", "missing.bin", "0", None, ["No such file"]),
    ("folder", "sub", "0", None, ["not a regular file"]),
    ("fifo", "pipe", "0", None, ["not a regular file"]),
    ("past_end", "data.bin", "200", None, ["has 256 bytes", "[200, 456)"]),
    ("negative_offset", "data.bin", "-4", None, ["not a non-negative integer"]),
    ("word_length", "data.bin", "0", "lots", ["not a non-negative integer"]),
    ("short_length", "data.bin", "0", "8", ["length 8", "need 256 bytes"]),
    ("huge_offset", "data.bin", "9" * 19, None, ["has 256 bytes"]),
    ("ort_memory", "*/_ORT_MEM_ADDR_/*", "0", None, ["odd characters"]),
])
def test_bad_external_data_is_one_line(tmp_path, case, location, offset, length, words):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "outside.bin").write_bytes(bytes(256))
    (folder / "data.bin").write_bytes(bytes(256))
    (folder / "sub").mkdir()
    os.mkfifo(folder / "pipe")  # opening it would block forever
    path = save_raw(external(head_through([]), location, offset, length), folder / f"{case}.onnx")
    code, _, err = inspect_cli(path, timeout=30)
    assert one_line_error(code, err, *words), err


def test_a_dense_data_file_whose_range_tensors_share_is_not_sparse(tmp_path):
    width = 1 << 16
    rows = (65 << 20) // (4 * width)  # past the 64 MiB from which holes are looked for
    table = np.ones((rows, width), np.float32)
    (tmp_path / "data.bin").write_bytes(table.tobytes())
    nodes, inits = [], []
    for name in ("a", "b", "c"):  # three tensors over one range of a dense file
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=table.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "data.bin"), ("offset", "0"), ("length", str(table.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        inits.append(tensor)
        nodes.append(helper.make_node("Gather", [name, "ids"], [f"e{name}"]))
    model = model_of(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                     [helper.make_tensor_value_info(f"e{n}", TensorProto.FLOAT, None) for n in "abc"], inits)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert sorted(load(path).tensors) == ["a", "b", "c"]  # read, not refused as sparse
    os.truncate(tmp_path / "data.bin", 0)
    os.truncate(tmp_path / "data.bin", table.nbytes)  # now it is a hole: refused
    with pytest.raises(InspectError, match="sparse"):
        load(path)


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


def constant_shape_model(folder):
    """GatherBlockQuantized rows reshaped by a Constant whose value is external data (c.bin beside the model)."""
    np.array([1, 32], np.int64).tofile(folder / "c.bin")
    shape = TensorProto(name="shape_c", data_type=TensorProto.INT64, dims=[2], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "c.bin"), ("offset", "0"), ("length", "16")):
        entry = shape.external_data.add()
        entry.key, entry.value = key, value
    nodes = [helper.make_node("GatherBlockQuantized", ["table", "ids", "scales"], ["rows"], domain="com.microsoft",
                              block_size=32, bits=4),
             helper.make_node("Constant", [], ["shp"], value=shape), helper.make_node("Reshape", ["rows", "shp"], ["out"])]
    model = model_of(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                     [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                     [numpy_helper.from_array(np.zeros((16, 16), np.uint8), "table"),
                      numpy_helper.from_array(np.ones((16, 1), np.float32), "scales")])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, folder / "model.onnx")
    return folder / "model.onnx"


def test_a_constant_with_external_data_is_never_read_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "elsewhere").mkdir()
    path = constant_shape_model(tmp_path / "model")
    np.array([4, 8], np.int64).tofile(tmp_path / "elsewhere" / "c.bin")  # what a path resolved here would read
    monkeypatch.chdir(tmp_path / "elsewhere")
    model = load(path)
    producer = {out: node for node in model.proto.graph.node for out in node.output}
    assert constants.constant("shp", producer, model) is None  # not read at all: onnx would resolve it here
    code, _, err = inspect_cli(path, cwd=tmp_path)  # a folder with no c.bin: once a traceback
    # onnxruntime itself cannot load a Constant whose value is external data ("Cannot parse data from external
    # tensors"): the model is checked, then refused in one line, not reported on
    assert one_line_error(code, err, "model.onnx: onnxruntime cannot load it"), err


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


# --- the files beside a model -----------------------------------------------------------------------------------------

def genai_copy(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(os.path.join(FIXTURES, "genai_fp32"), folder)
    return folder


@pytest.mark.parametrize("name", ["config.json", "genai_config.json"])
def test_a_sidecar_nested_past_the_parsers_depth_is_ignored(tmp_path, name):
    folder = genai_copy(tmp_path)
    (folder / name).write_text("[" * 200000 + "]" * 200000)
    code, out, err = inspect_cli(folder / "model.onnx")
    assert code == 0 and "vocabulary:" in out and "Traceback" not in err, err


def test_a_device_where_a_sidecar_is_looked_for_is_not_opened(tmp_path):
    folder = genai_copy(tmp_path)
    try:
        os.mknod(folder / "config.json", 0o600 | 0o020000, os.makedev(1, 3))  # a character device (/dev/null's)
    except (PermissionError, OSError):
        pytest.skip("cannot make a device node here")
    code, out, err = inspect_cli(folder / "model.onnx")
    assert code == 0 and "vocabulary:" in out, err


# --- the fuzzer -------------------------------------------------------------------------------------------------------

FUZZ_CASES = int(os.environ.get("ONNX_LAB_FUZZ_CASES", "300"))


CASE_SECONDS = 60  # generous for a shared 2-core machine; a hang runs forever


def _seeds(folder):
    """Valid models to mutate: the lab's heads, real torch exports, and one with external data."""
    models = {name: onnx.load(os.path.join(FIXTURES, name + ".onnx"))
              for name in ("torchscript_tied", "dynamo_tied", "dynamo_tied_large")}
    models["lab_tied"] = graphs.tied_logits(graphs.make_table(32, 8))
    models["lab_untied"] = graphs.untied_logits(graphs.make_table(32, 8), graphs.make_table(32, 8, seed=1))
    models["lab_neighbors"] = graphs.neighbors(graphs.make_table(32, 8), "cosine")
    models["duplicate"] = head_through([helper.make_node("Identity", ["embedding"], ["copy"])])
    for name in ("genai_fp32", "genai_int4", "optimum_gpt2"):  # contrib ops, KV caches, 4-bit blocks
        models[name] = onnx.load(os.path.join(FIXTURES, name, "model.onnx"))
    return models


OPS = ["Identity", "Transpose", "Gather", "MatMul", "Gemm", "Reshape", "Cast", "Add", "Relu", "NoSuchOp", ""]


LOCATIONS = ["data.bin", "../data.bin", "/etc/hostname", "d\x00.bin", "", "missing.bin", "sub/../data.bin",
             "*/_ORT_MEM_ADDR_/*", "data.bin\n", "sub"]


NUMBERS = ["0", "1", "-1", "64", "4096", "99999999999999999999", "x", "", "1e3"]


def _names(graph):
    names = [t.name for t in graph.initializer] + [v.name for v in graph.input]
    return names + [o for n in graph.node for o in n.output] + ["", "nowhere"]


def _mutate(model, rng, folder):
    """One structure-aware change to `model`, in place; returns what it did."""
    graph = model.graph
    nodes, inits = list(graph.node), list(graph.initializer)
    kind = rng.choice(["op", "input", "attribute", "dims", "data_type", "external", "raw", "output", "opset",
                       "attribute_type", "name", "function", "sidecar"])
    if kind == "op" and nodes:
        rng.choice(nodes).op_type = rng.choice(OPS)
    elif kind == "input" and nodes:
        node = rng.choice(nodes)
        if node.input:
            node.input[rng.randrange(len(node.input))] = rng.choice(_names(graph) + list(node.output))
    elif kind == "attribute" and nodes:
        node = rng.choice(nodes)
        if node.attribute and rng.random() < 0.5:
            del node.attribute[rng.randrange(len(node.attribute))]
        else:
            name = rng.choice(["perm", "transB", "transA", "axis", "to"])
            value = [rng.randint(-3, 3) for _ in range(rng.randint(1, 3))] if name == "perm" else rng.randint(-3, 30)
            kept = [a for a in node.attribute if a.name != name]
            del node.attribute[:]
            node.attribute.extend(kept + [helper.make_attribute(name, value)])
    elif kind == "dims" and inits:
        tensor = rng.choice(inits)
        choice = rng.random()
        if choice < 0.3 and tensor.dims:
            tensor.dims[rng.randrange(len(tensor.dims))] = rng.choice([-1, 0, 1, 3, 2**31, 2**62])
        elif choice < 0.6:
            tensor.dims.append(rng.choice([1, 2, 7]))
        elif tensor.dims:
            del tensor.dims[-1]
    elif kind == "data_type" and inits:
        rng.choice(inits).data_type = rng.choice(list(range(0, 30)) + [9999, 2**31 - 1])
    elif kind == "external" and inits:
        tensor = rng.choice(inits)
        raw = tensor.raw_data
        (folder / "data.bin").write_bytes(bytes(rng.randrange(0, 64)) + raw)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key in ("location", "offset", "length", rng.choice(["checksum", "location", "offset"])):
            if rng.random() < 0.8:
                entry = tensor.external_data.add()
                entry.key = key
                entry.value = rng.choice(LOCATIONS) if key == "location" else rng.choice(NUMBERS + [str(len(raw))])
    elif kind == "raw" and inits:
        tensor = rng.choice(inits)
        if tensor.raw_data:
            tensor.raw_data = tensor.raw_data[:rng.randrange(len(tensor.raw_data))]
    elif kind == "output" and graph.output:
        graph.output[0].name = rng.choice(_names(graph))
    elif kind == "opset":
        model.opset_import[0].version = rng.choice([1, 7, 12, 13, 99])
    elif kind == "attribute_type" and nodes:
        _retype_attribute(rng.choice(nodes), rng)
    elif kind == "name":
        _rename(graph, rng)
    elif kind == "function":
        _add_function(model, rng)
    elif kind == "sidecar":
        _sidecar(folder, rng)
    return kind


ATTRIBUTES = ["transB", "transA", "perm", "axis", "to", "N", "K", "bits", "block_size", "local_window_size"]


HOSTILE_TEXT = ["\x1b[2J", "\x1b]0;title\x07", "a\nvocabulary: forged", "\u2028", "\x00", "\u202e"]


def _retype_attribute(node, rng):
    """An attribute an op reads as an int, given as a string, a float, a tensor, untyped, or a reference."""
    name = rng.choice(ATTRIBUTES)
    kept = [a for a in node.attribute if a.name != name]
    choice = rng.randrange(5)
    if choice == 0:
        attr = helper.make_attribute(name, rng.choice(["1", "", "\x1b"]))
    elif choice == 1:
        attr = helper.make_attribute(name, rng.choice([1.5, float("nan"), 1e300]))
    elif choice == 2:
        attr = helper.make_attribute(name, numpy_helper.from_array(np.ones(rng.choice([0, 1, 3]), np.int64)))
    elif choice == 3:
        attr = onnx.AttributeProto(name=name)  # no type, no value
    else:
        attr = onnx.AttributeProto(name=name, ref_attr_name="outer", type=onnx.AttributeProto.INT)
    del node.attribute[:]
    node.attribute.extend(kept + [attr])


def _rename(graph, rng):
    """An initializer, node, op or value named with control characters (each use of it renamed alike)."""
    inits = list(graph.initializer)
    text = rng.choice(HOSTILE_TEXT)
    if inits and rng.random() < 0.6:
        tensor = rng.choice(inits)
        old, new = tensor.name, tensor.name + text
        tensor.name = new
        for node in graph.node:
            node.input[:] = [new if x == old else x for x in node.input]
    elif graph.node:
        node = rng.choice(list(graph.node))
        setattr(node, rng.choice(["name", "op_type", "domain"]), node.name + text)


def _add_function(model, rng):
    """A FunctionProto whose body holds a Constant tensor, malformed or not, perhaps called from the graph."""
    value = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "c")
    change = rng.randrange(4)
    if change == 1:
        value.dims[0] = rng.choice([-1, 2**40])
    elif change == 2:
        value.raw_data = value.raw_data[:5]
    elif change == 3:
        value.ClearField("raw_data")
        value.data_location = TensorProto.EXTERNAL
        entry = value.external_data.add()
        entry.key, entry.value = "location", rng.choice(LOCATIONS)
    body = [helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Add", ["x", "c"], ["y"])]
    model.functions.append(helper.make_function("lab.fuzz", "F", ["x"], ["y"], body,
                                                [helper.make_opsetid("", 21)]))
    model.opset_import.append(helper.make_opsetid("lab.fuzz", 1))
    if model.graph.node and rng.random() < 0.5:
        node = rng.choice(list(model.graph.node))
        model.graph.node.append(helper.make_node("F", [node.output[0]], ["fuzz_out"], domain="lab.fuzz"))


SIDECAR_NAMES = ["genai_config.json", "config.json", "tokenizer.json", "generation_config.json"]


def _sidecar(folder, rng):
    """A file beside the model that inspect reads or --retie copies: bad JSON, odd values, a FIFO, a link out of
    the folder, a folder, or large."""
    path = folder / rng.choice(SIDECAR_NAMES)
    if path.exists() or path.is_symlink():
        return
    choice = rng.randrange(6)
    if choice == 0:
        path.write_text(rng.choice(["{", "null", "[]", '{"model": 7}', "\x1b[2J"]))
    elif choice == 1:
        window = rng.choice([-1, 0, 1, 65535, 10**12, "32", 1.5, None, True])
        path.write_text(json.dumps({"model": {"decoder": {"filename": rng.choice(["model.onnx", "../x", "\x1b"]),
                                                          "sliding_window": {"window_size": window},
                                                          "head_size": window}, "context_length": window},
                                    "sliding_window": window, "max_position_embeddings": window}))
    elif choice == 2:
        os.mkfifo(path)
    elif choice == 3:
        os.symlink("/etc/hostname", path)
    elif choice == 4:
        path.mkdir()
    else:
        with open(path, "wb") as f:  # sparse and past any sidecar's limit
            f.truncate(rng.choice([17 << 20, 1 << 33]))


def _bytes_mutation(data, rng):
    if rng.random() < 0.5:
        return data[:rng.randrange(len(data))], "truncate"
    data = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data), "flip"


def _listing(folder):
    return sorted(os.listdir(folder))


class _Hang(BaseException):
    """Raised by the alarm: a BaseException, so no `except Exception` in the code under test can turn a hang into
    an ordinary answer."""


def _alarm(signum, frame):
    raise _Hang()


def run_case(seeds, index, root):
    """Build case `index` from the seeds, run the command in-process, check the answer. Returns (code, what)."""
    rng = random.Random(index)
    name = rng.choice(sorted(seeds))
    model = onnx.ModelProto()
    model.CopyFrom(seeds[name])
    folder = root / f"case{index}"
    folder.mkdir()
    (folder / "sub").mkdir()
    done = [_mutate(model, rng, folder) for _ in range(rng.randint(1, 3))]
    data = model.SerializeToString()
    if rng.random() < 0.25:
        data, how = _bytes_mutation(data, rng)
        done.append(how)
    elif rng.random() < 0.1 and model.graph.initializer:  # a name that is not UTF-8: only bytes can say it
        name = rng.choice(list(model.graph.initializer)).name.encode()
        data = data.replace(name, b"\xff\xfe" + name[2:]) if len(name) >= 2 else data
        done.append("not utf-8")
    path = folder / "model.onnx"
    path.write_bytes(data)
    before, digest = _listing(folder), hashlib.sha256(data).hexdigest()
    args = [str(path), "--timeout", "30"] + (["--json"] if rng.random() < 0.5 else [])
    retie = rng.random() < 0.2
    if retie:
        args += ["--retie", str(folder / "out.onnx")]
    out, err = io.StringIO(), io.StringIO()
    what = f"case {index} from {name}: {done}{' --retie' if retie else ''}"
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_SECONDS)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args, supervised=False)  # in this process: its output is captured here
    except _Hang:
        pytest.fail(f"{what}: no answer within {CASE_SECONDS} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    err = err.getvalue()
    assert code in (0, 1, 2), what
    assert "Traceback" not in err, what
    if code == 2:
        assert err.count("\n") == 1, f"{what}: {err!r}"
    if code == 0 and "--json" in args:
        json.loads(out.getvalue())
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, what  # the input is never touched
    written = set(_listing(folder)) - set(before)
    allowed = {"out.onnx", "out.onnx.data"} if (retie and code == 0) else set()
    assert written <= allowed, f"{what}: wrote {sorted(written)}"
    return code, what


def test_the_fuzzer_tells_a_hang_from_an_answer(tmp_path, monkeypatch):
    """A command that hangs inside a broad `except Exception` (as a handler that answers 2 on any error would)
    still fails its case, and within the case's seconds."""
    def hangs_under_a_broad_except(args, supervised):
        try:
            time.sleep(60)
        except Exception:  # what must not swallow the alarm
            return 2
        return 0
    monkeypatch.setattr(sys.modules[__name__], "main", hangs_under_a_broad_except)
    monkeypatch.setattr(sys.modules[__name__], "CASE_SECONDS", 1)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="no answer within 1 s"):
        run_case({"lab_tied": graphs.tied_logits(graphs.make_table(32, 8))}, 0, tmp_path)
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_fuzz_inspect(tmp_path):
    seeds = _seeds(tmp_path)
    codes = [run_case(seeds, i, tmp_path)[0] for i in range(FUZZ_CASES)]
    # The fuzzer must reach both sides: models that read (0) and models refused as unsafe (2).
    assert codes.count(0) > FUZZ_CASES // 20 and codes.count(2) > FUZZ_CASES // 5, \
        {c: codes.count(c) for c in set(codes)}
