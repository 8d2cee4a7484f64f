"""runtime.inspect on hostile files: one named test per way it once failed, then a seeded structure-aware fuzzer.

Every answer must be exit 0 (a report), 1 (retie not proven) or 2 (one line on stderr), with no traceback,
quickly, and with nothing written beside the model but --retie's output.
"""
import contextlib
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from runtime.inspect import main
from tests.helpers import FIXTURES, ROOT

FUZZ_CASES = int(os.environ.get("ONNX_LAB_FUZZ_CASES", "300"))
CASE_SECONDS = 60  # generous for a shared 2-core machine; a hang runs forever


def inspect_cli(*args, timeout=120):
    """The real command in a subprocess: (exit status, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-m", "runtime.inspect", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def one_line_error(code, err, *words):
    return (code == 2 and err.count("\n") == 1 and "Traceback" not in err
            and all(w in err for w in words))


def model_of(nodes, inputs, outputs, initializers):
    graph = helper.make_graph(nodes, "hostile", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def head_through(nodes, table=None):
    """ids -> Gather(table); hidden -> MatMul(hidden, <the last of `nodes`>) -> logits."""
    table = graphs.make_table(16, 4) if table is None else table
    return model_of(
        [helper.make_node("Gather", ["embedding", "ids"], ["embeddings"])] + nodes
        + [helper.make_node("MatMul", ["hidden", nodes[-1].output[0] if nodes else "embedding"], ["logits"])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
         helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 16])],
        [numpy_helper.from_array(table, "embedding")])


def save_raw(model, path):
    """Write without any checker: these files are meant to be broken."""
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


# --- one test per bug -----------------------------------------------------------------------------

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


def test_onnxruntime_out_of_memory_is_a_finding(tmp_path):
    big, small = tmp_path / "big.onnx", tmp_path / "small.onnx"
    graphs.save(graphs.tied_logits(graphs.make_table(32768, 1024)), big)  # a 128 MiB table
    graphs.save(graphs.tied_logits(graphs.make_table(64, 8)), small)
    assert inspect_cli(small, "--memory-limit", "0.4")[0] == 0  # the limit leaves room for onnxruntime itself
    code, _, err = inspect_cli(big, "--memory-limit", "0.4")
    assert one_line_error(code, err, "onnxruntime ran out of memory", "0.4 GiB", "--memory-limit")


def test_onnxruntime_time_out_is_a_finding(tmp_path):
    path = tmp_path / "m.onnx"
    graphs.save(graphs.tied_logits(graphs.make_table(64, 8)), path)
    start = time.monotonic()
    code, _, err = inspect_cli(path, "--timeout", "0.05")
    assert one_line_error(code, err, "did not finish", "--timeout 0.05 s")
    assert time.monotonic() - start < 10


def test_exit_codes_are_documented():
    code, out, _ = inspect_cli("--help")
    assert code == 0
    assert "0 report written" in out and "1 the retie proof failed" in out and "2 bad usage" in out
    assert "--timeout" in out and "--memory-limit" in out


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_bad_limits_are_usage_errors(value):
    code, _, err = inspect_cli(os.path.join(FIXTURES, "torchscript_tied.onnx"), "--timeout", value)
    assert one_line_error(code, err, "positive number")


# --- the fuzzer -----------------------------------------------------------------------------------

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


class _Hang(Exception):
    pass


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


def test_fuzz_inspect(tmp_path):
    seeds = _seeds(tmp_path)
    codes = [run_case(seeds, i, tmp_path)[0] for i in range(FUZZ_CASES)]
    # The fuzzer must reach both sides: models that read (0) and models refused as unsafe (2).
    assert codes.count(0) > FUZZ_CASES // 20 and codes.count(2) > FUZZ_CASES // 5, \
        {c: codes.count(c) for c in set(codes)}
