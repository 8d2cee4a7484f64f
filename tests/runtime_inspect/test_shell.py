"""An inline model read as a shell (runtime.model.read.wire): its large tensors' raw data left where it lies in the
file and read from there, what protobuf itself parses of the file kept field for field, and bytes that are no
model (truncated, mutated, nested past the walk's depth) refused in one line or handed to protobuf to judge; then
the child's side of the contract: the file it opens is the file checked."""
import os
import random

import numpy as np
import onnx
import pytest
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

import graphs
from runtime.model.read import checked as read_checked
from runtime.model.read import wire
from runtime.model.read.model import all_tensors, load
from runtime.model.read.text import InspectError
from tests.helpers import FIXTURES


def _inline(path, vocab=4096, width=16):
    """A tied model saved inline whose table and head (vocab x width float32: 256 KiB each) are past LAZY_FROM."""
    model = graphs.tied_logits(graphs.make_table(vocab, width))
    onnx.save(model, path)  # onnx's writer: every tensor inline
    return onnx.load(path)


def test_large_inline_tensors_are_read_where_they_lie(tmp_path):
    path = tmp_path / "m.onnx"
    original = _inline(path)
    model = load(path)
    assert model.checked["lazy"] and model.checked["size"] == os.path.getsize(path)
    arrays = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}  # what onnx reads, all of it
    lazy = [t for t in model.tensors.values() if t.stored is not None]
    assert lazy and all(t.nbytes >= wire.LAZY_FROM for t in lazy)
    for tensor in model.tensors.values():
        assert tensor.external is None  # inline, as far as anything downstream is told
        assert np.array_equal(tensor.values(), arrays[tensor.name])
        assert bytes(tensor.raw()) == arrays[tensor.name].tobytes()
    held = sum(len(t.raw_data) for t in model.proto.graph.initializer)
    assert held < wire.LAZY_FROM and held + sum(t.nbytes for t in lazy) == sum(a.nbytes for a in arrays.values())


def test_a_large_inline_tensor_of_the_wrong_length_is_one_line(tmp_path):
    model = graphs.tied_logits(graphs.make_table(4096, 16))
    table = next(t for t in model.graph.initializer if t.dims[0] == 4096)
    table.dims[0] = 4095  # its raw data holds a row more than its dims
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(InspectError, match="raw data holds 262144 bytes, dims \\[4095, 16\\] of FLOAT need 262080"):
        load(path)


def _restored(shell_bytes, data, lazy):
    """The shell parsed, each lazy tensor given back its raw data from `data` (the file's bytes)."""
    model = onnx.ModelProto()
    model.ParseFromString(shell_bytes)
    for tensor, _ in all_tensors(model.graph, model.functions):
        entries = {e.key: e.value for e in tensor.external_data}
        if tensor.data_location == TensorProto.EXTERNAL and int(entries.get("offset", -1)) in lazy:
            offset, length = int(entries["offset"]), int(entries["length"])
            assert lazy[offset] == length
            del tensor.external_data[:]
            tensor.ClearField("data_location")
            tensor.raw_data = data[offset:offset + length]
    return model


def _read(path):
    with open(path, "rb", buffering=0) as f:
        return wire.read(f, os.path.getsize(path), os.path.basename(path))


def _without_explicit_location(model):
    """`model` with every tensor's data_location DEFAULT cleared (protobuf keeps whether an optional field was set;
    the restored shell cannot say it was)."""
    for tensor, _ in all_tensors(model.graph, model.functions):
        if tensor.HasField("data_location") and tensor.data_location == TensorProto.DEFAULT:
            tensor.ClearField("data_location")
    return model


def _seeds():
    """Serialized models with subgraphs, functions, Constants and sparse tensors: every message the walk enters."""
    seeds = [open(os.path.join(FIXTURES, "optimum_gpt2", "model.onnx"), "rb").read(),
             open(os.path.join(FIXTURES, "dynamo_tied.onnx"), "rb").read()]
    values = helper.make_tensor("v", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    indices = helper.make_tensor("i", TensorProto.INT64, [3], [0, 5, 9])
    sparse = helper.make_sparse_tensor(values, indices, [10])
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.arange(40, dtype=np.float32)))
    body = helper.make_graph([helper.make_node("Add", ["c", "x"], ["y"])], "body", [],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [40])])
    branch = helper.make_node("If", ["cond"], ["z"], then_branch=body, else_branch=body)
    graph = helper.make_graph([const, branch], "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [40])],
                              [numpy_helper.from_array(np.ones(40, np.float32), "x")], sparse_initializer=[sparse])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.functions.append(helper.make_function("lab", "F", ["a"], ["b"], [const], [helper.make_opsetid("", 17)]))
    return seeds + [model.SerializeToString()]


def _mutated(data, rng):
    how = rng.choice(["truncate", "flip", "insert", "repeat"]) if data else "insert"
    at = rng.randrange(len(data)) if data else 0
    if how == "truncate":
        return data[:at]
    if how == "flip":
        return data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]
    if how == "insert":
        return data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 12))) + data[at:]
    span = data[at:at + rng.randint(1, 64)]
    return data[:at] + span + data[at:]


def test_the_shell_is_what_protobuf_parses_of_mutated_files(tmp_path, monkeypatch):
    monkeypatch.setattr(wire, "LAZY_FROM", 16)  # every tensor of these small models is left in the file
    rng, path, seeds = random.Random(0), tmp_path / "m.onnx", _seeds()
    answers = {"refused": 0, "same": 0}
    for case in range(1500):
        data = rng.choice(seeds)
        for _ in range(0 if case < 10 else rng.randint(1, 2)):
            data = _mutated(data, rng)
        path.write_bytes(data)
        try:  # protobuf is the judge of the bytes; the shell must say what it says
            original = onnx.ModelProto.FromString(data)
        except DecodeError:
            original = None
        try:
            shell = _read(path)
        except InspectError as e:
            assert "\n" not in str(e) and original is None, f"case {case}: {e}"  # refused: no model either way
            answers["refused"] += 1
            continue
        if original is None:
            continue  # what protobuf refuses in the shell's verbatim parts it refuses there too (load says so)
        assert len(shell.data) <= len(data) + 64 * len(shell.lazy) and shell.size == len(data)
        restored = _restored(shell.data, data, shell.lazy)
        assert _without_explicit_location(restored) == _without_explicit_location(original), f"case {case}"
        answers["same"] += 1
    assert answers["refused"] > 100 and answers["same"] > 100, answers  # both sides reached


def test_messages_nested_past_the_walks_depth_are_left_to_protobuf(tmp_path):
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
                              [numpy_helper.from_array(np.zeros(20000, np.float32), "deep")])
    empty = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "e", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    for depth in range(15):  # an If inside an If, 15 deep (45 messages), the large tensor at the bottom
        node = helper.make_node("If", ["c"], ["y"], then_branch=graph, else_branch=empty, name=f"if{depth}")
        graph = helper.make_graph([node], f"g{depth}", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    path = tmp_path / "deep.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    shell = _read(path)
    assert not shell.lazy and shell.data == path.read_bytes()  # copied as it is: protobuf parses what it would
    assert load(path).file_bytes == os.path.getsize(path)


def _message(*fields):
    """Serialized fields (number, serialized message) in order, as protobuf writes length-delimited ones."""
    return b"".join(wire._string(number, data) for number, data in fields)


def test_a_tensor_given_twice_in_one_attribute_is_refused(tmp_path):
    big = numpy_helper.from_array(np.zeros(20000, np.float32), "t").SerializeToString()
    attribute = _message((1, b"value"), (5, big), (5, big))  # AttributeProto.t twice: protobuf would merge them
    node = _message((2, b"y"), (4, b"Constant"), (5, attribute))
    graph = _message((1, node), (2, b"g"))
    model = helper.make_model(helper.make_graph([], "g", [], []), opset_imports=[helper.make_opsetid("", 17)])
    model.ClearField("graph")
    path = tmp_path / "twice.onnx"
    path.write_bytes(model.SerializeToString() + _message((7, graph)))
    onnx.ModelProto.FromString(path.read_bytes())  # protobuf takes it
    with pytest.raises(InspectError, match="given twice"):
        load(path)


def test_the_child_opens_the_file_checked_by_its_descriptor(tmp_path):
    path = tmp_path / "m.onnx"
    _inline(path)
    model = load(path)
    checked = read_checked.source(model.checked)
    opened, folder = checked.as_user()
    assert folder is None and os.path.samefile(opened, path)  # the user's load: the file itself
    os.replace(path, tmp_path / "moved.onnx")  # renamed away since: the descriptor still reads the file checked
    _inline(path, vocab=2048)
    assert os.path.samefile(opened, tmp_path / "moved.onnx")
    checked.close()
    with pytest.raises(read_checked.Changed, match="changed after it was checked"):
        read_checked.source(model.checked)  # by name, now another file


def test_a_model_rewritten_after_the_check_is_changed(tmp_path):
    path = tmp_path / "m.onnx"
    _inline(path)
    model = load(path)
    with open(path, "ab") as f:
        f.write(b"\0")  # one byte more: another size
    with pytest.raises(read_checked.Changed, match="changed after it was checked"):
        read_checked.source(model.checked)
    data = path.read_bytes()[:-1]
    path.write_bytes(data.replace(b"embedding", b"embeddinh", 1))  # a name, same size: the shell's digest tells
    os.utime(path, ns=(model.checked["identity"][3],) * 2)  # even with the mtime it had
    with pytest.raises(read_checked.Changed, match="changed after it was checked"):
        read_checked.source(model.checked)
