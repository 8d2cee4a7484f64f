"""The copies constant folding makes of a table, told by the node that made them instead of written with the
optimized model's data (sandbox.folding.folded_from): each claim checked against the values onnxruntime holds,
read from its optimized model written with its data, and numpy's own transpose or widening of the table."""
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnxruntime.transformers.float16 import convert_float_to_float16

from runtime.inspect.examine import inspect_model
from runtime import resident
from runtime.inspect.sandbox import folding
from runtime.model.findings.copies import runtime_copies
from runtime.model.read.model import load
from runtime.resident import made
from runtime.optimized import write_optimized_layout, write_optimized_model
from tests.helpers import FIXTURES, tied

GENAI = os.path.join(FIXTURES, "genai_fp32", "model.onnx")  # the lookup reads the tied head through a Transpose


def _held(model, tmp_path, name):
    """The values onnxruntime's optimizer made under `name`, from its optimized model written with its data."""
    path = str(tmp_path / "with_data.onnx")
    write_optimized_model(model, path)
    (tensor,) = [t for t in onnx.load(path).graph.initializer if t.name == name]
    return numpy_helper.to_array(tensor)


def _bits_equal(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_a_folded_transpose_of_the_table_is_told_by_its_node_and_holds_the_table_transposed(tmp_path):
    layout_path = str(tmp_path / "optimized.onnx")
    write_optimized_layout(GENAI, layout_path)
    proto, layout = onnx.load(GENAI, load_external_data=False), onnx.load(layout_path, load_external_data=False)
    table = numpy_helper.to_array(onnx.load(GENAI).graph.initializer[
        [t.name for t in proto.graph.initializer].index("lm_head.MatMul.weight")])
    folded = folding.folded_from(proto, layout, [table.size])
    ((name, told),) = folded.items()
    assert name in {t.name for t in made(proto, layout)}  # the name the optimized model holds it under
    assert told == {"of": "lm_head.MatMul.weight", "view": "transposed"}
    assert _bits_equal(_held(GENAI, tmp_path, name), table.T)  # what onnxruntime holds there, as numpy transposes


def test_inspect_tells_the_copy_by_its_node_and_writes_no_data_file(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_model(GENAI, str(scratch))
    written = sorted(n for n in os.listdir(scratch) if n.startswith("optimized"))  # beside the job's own files
    assert written == ["optimized.onnx"]  # the layout alone: no data, no copy made again
    (copy,) = [c for c in found.runtime_copies if c.get("copy_of") == "lm_head.MatMul.weight" and
               c["view"] != "prepacked"]
    assert copy["view"] == "transposed"
    assert copy["shape"] == found.model.tensors["lm_head.MatMul.weight"].dims[::-1]


def test_a_claim_the_dims_do_not_bear_out_names_no_copy(tmp_path):
    layout_path = str(tmp_path / "optimized.onnx")
    write_optimized_layout(GENAI, layout_path)
    model, optimized = load(GENAI), load(layout_path, layout_only=True)
    proto = onnx.load(GENAI, load_external_data=False)
    folded = folding.folded_from(proto, optimized.proto, [model.tensors["lm_head.MatMul.weight"].elements])
    ((name, told),) = folded.items()
    copies = {c["name"]: c for c in runtime_copies(model, optimized, ["lm_head.MatMul.weight"], folded)}
    assert copies[name]["view"] == "transposed"
    for view in ("same", "widened"):  # a transposed [width, vocab] copy is neither the table as it is nor widened
        wrong = {name: dict(told, view=view)}
        assert "copy_of" not in {c["name"]: c for c in runtime_copies(model, optimized, ["lm_head.MatMul.weight"],
                                                                       wrong)}[name]


def _float16(tmp_path, vocab=64, width=8):
    path = str(tmp_path / "m.onnx")
    onnx.save(convert_float_to_float16(onnx.load(tied(str(tmp_path / "float32.onnx"), vocab, width)),
                                       keep_io_types=True), path)
    return path


def _widened(tmp_path, vocab=64, width=8):
    """(the float16 model's path, its proto, its optimized layout, the float32 copy of its table the layout holds)."""
    path, layout_path = _float16(tmp_path, vocab, width), str(tmp_path / "optimized.onnx")
    write_optimized_layout(path, layout_path)
    proto, layout = onnx.load(path), onnx.load(layout_path, load_external_data=False)
    (widened,) = [t for t in made(proto, layout) if np.prod(t.dims) == vocab * width]
    return path, proto, layout, widened


def test_a_widened_float16_copy_is_told_by_its_name_and_holds_the_table_as_numpy_widens_it(tmp_path):
    vocab, width = 64, 8
    path, proto, layout, widened = _widened(tmp_path, vocab, width)
    assert widened.data_type == onnx.TensorProto.FLOAT and widened.name.startswith(folding.WIDENED)
    (table,) = [t for t in proto.graph.initializer if np.prod(t.dims) == vocab * width]
    assert folding.folded_from(proto, layout, [vocab * width]) == {widened.name: {"of": table.name,
                                                                                  "view": "widened"}}
    values = numpy_helper.to_array(table)
    assert values.dtype == np.float16  # float16 -> float32 is exact: one answer
    assert _bits_equal(_held(path, tmp_path, widened.name), values.astype(np.float32))


def test_a_widened_copy_two_weights_could_be_is_not_told(tmp_path):
    # onnxruntime names W's widening FusedBack_W, or FusedBack_W_token_0 where that name is taken: beside a weight
    # named W_token_0 of W's dims, FusedBack_W_token_0 could be either's, so it is left to the data write
    vocab, width = 64, 8
    _, proto, layout, widened = _widened(tmp_path, vocab, width)
    (table,) = [t for t in proto.graph.initializer if t.name == widened.name[len(folding.WIDENED):]]
    widened.name += "_token_0"  # as onnxruntime names it where FusedBack_<table> is taken
    assert folding.folded_from(proto, layout, [vocab * width]) == {  # the suffix alone: still the table's widening
        widened.name: {"of": table.name, "view": "widened"}}
    other = onnx.TensorProto()
    other.CopyFrom(table)
    other.name = table.name + "_token_0"  # another weight, of the same dims, that the copy could be the widening of
    proto.graph.initializer.append(other)
    assert folding.folded_from(proto, layout, [vocab * width]) is None


def test_a_transpose_other_than_2d_is_not_told(tmp_path):
    layout_path = str(tmp_path / "optimized.onnx")
    write_optimized_layout(GENAI, layout_path)
    proto, layout = onnx.load(GENAI, load_external_data=False), onnx.load(layout_path, load_external_data=False)
    size = [t for t in proto.graph.initializer if t.name == "lm_head.MatMul.weight"][0]
    (node,) = [n for n in proto.graph.node if n.op_type == "Transpose" and n.input[0] == size.name]
    del node.attribute[:]
    node.attribute.extend([onnx.helper.make_attribute("perm", [1, 0, 2])])  # not a 2-D transpose: its data written
    assert folding.folded_from(proto, layout, [int(np.prod(size.dims))]) is None


def test_inspect_of_a_float16_model_writes_no_data_file(tmp_path):
    path = _float16(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_model(path, str(scratch))
    written = sorted(n for n in os.listdir(scratch) if n.startswith("optimized"))
    assert written == ["optimized.onnx"]
    (copy,) = [c for c in found.runtime_copies if str(c.get("view", "")).startswith("widened")]
    assert copy["copy_of"] == found.vocabulary[0]["table"]  # told by the name the CPU provider gives it


def _external(name, dims, **entries):
    tensor = onnx.TensorProto(name=name, dims=dims, data_type=onnx.TensorProto.FLOAT,
                              data_location=onnx.TensorProto.EXTERNAL)
    for key, value in {"location": "m.onnx.data", **entries}.items():
        tensor.external_data.add(key=key, value=value)
    return tensor


@pytest.mark.skipif(not resident._mapped_alone(), reason="malloc here does not map large allocations alone")
def test_a_large_folded_copy_counts_as_held_once_written_only_where_a_kernel_prepacked_it():
    # failed before: a 519 MiB folded Transpose MatMul prepacks was left out as mapped alone, and a session that
    # wrote its layout measured 2449.9 MiB where the session alone adds 1911.9 MiB
    elements = 9 * 2**20  # 36 MiB of float32: past MAPPED_ALONE
    original = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [], [_external("w", [elements])]))
    for packed, held in ((False, 0), (True, 4 * elements)):
        entries = {"prepacked_0": "MatMul+0|0;1024"} if packed else {}
        layout = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [], [
            _external("w", [elements]), _external("w_transposed", [elements], **entries)]))
        assert resident.owned_bytes(original, layout) == held


def test_a_folded_tensor_the_model_names_as_a_widening_is_compared_by_its_values(tmp_path):
    # a Cast then a Mul by 2 of a float16 table, the Mul's output named as onnxruntime names its own widening: not
    # the provider's copy, so not told by its name; its values (twice the table's) are compared, and it is no copy
    from onnx import TensorProto, helper
    from tests.helpers import model_of
    table = np.random.default_rng(3).standard_normal((16, 4)).astype(np.float16)
    name = folding.WIDENED + "embedding"
    model = model_of([helper.make_node("Gather", ["embedding", "ids"], ["embeddings"]),
                      helper.make_node("Cast", ["embedding"], ["wide"], to=TensorProto.FLOAT),
                      helper.make_node("Mul", ["wide", "two"], [name]),
                      helper.make_node("MatMul", ["hidden", name], ["logits"])],
                     [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                      helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", 16])],
                     [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT16, ["n", 4]),
                      helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 4])],
                     [numpy_helper.from_array(table, "embedding"),
                      numpy_helper.from_array(np.array(2, np.float32), "two")])
    path, layout_path = str(tmp_path / "m.onnx"), str(tmp_path / "optimized.onnx")
    onnx.save(model, path)
    write_optimized_layout(path, layout_path)
    proto, layout = onnx.load(path), onnx.load(layout_path, load_external_data=False)
    assert name in {t.name for t in made(proto, layout)}  # folded under the name the model gave it
    assert folding.folded_from(proto, layout, [table.size]) is None  # not told: its data written, its values compared
    assert _bits_equal(_held(path, tmp_path, name), 2 * table.astype(np.float32))  # twice the table: no copy
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_model(path, str(scratch))
    assert not [c for c in found.runtime_copies if c.get("copy_of")]
