"""The copies constant folding makes of a table, recomputed by onnxruntime from the node that made them instead of
written with the optimized model's data (sandbox.folding): the same values, bit for bit, as numpy's own transpose
of the table, and the CPU provider's float32 widening of a float16 table as numpy widens it."""
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnxruntime.transformers.float16 import convert_float_to_float16

from runtime.inspect.examine import inspect_model
from runtime import resident
from runtime.inspect.sandbox import folding
from runtime.resident import made
from runtime.runner import write_optimized_layout
from tests.helpers import FIXTURES, tied

GENAI = os.path.join(FIXTURES, "genai_fp32", "model.onnx")  # the lookup reads the tied head through a Transpose


def test_a_folded_transpose_of_the_table_is_recomputed_bit_for_bit(tmp_path):
    layout_path = str(tmp_path / "optimized.onnx")
    write_optimized_layout(GENAI, layout_path)
    proto, layout = onnx.load(GENAI, load_external_data=False), onnx.load(layout_path, load_external_data=False)
    table = numpy_helper.to_array(onnx.load(GENAI).graph.initializer[
        [t.name for t in proto.graph.initializer].index("lm_head.MatMul.weight")])
    copies = folding.recomputed(proto, layout, [table.size], os.path.dirname(GENAI))
    (copy,) = copies.graph.initializer
    assert copy.name in {t.name for t in made(proto, layout)}  # the name the optimized model holds it under
    values = numpy_helper.to_array(copy)
    assert values.shape == table.T.shape and np.array_equal(values.view(np.uint32), table.T.view(np.uint32))


def test_inspect_writes_the_copy_beside_the_layout_and_no_data_file(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_model(GENAI, str(scratch))
    written = sorted(n for n in os.listdir(scratch) if n.startswith("optimized"))  # beside the job's own files
    assert written == ["optimized.onnx", "optimized.onnx.copies.onnx"]
    (copy,) = [c for c in found["runtime_copies"] if c.get("copy_of") == "lm_head.MatMul.weight" and
               c["view"] != "prepacked"]
    assert copy["view"] == "transposed"  # told by comparing the recomputed values with the table's


def _float16(tmp_path, vocab=64, width=8):
    path = str(tmp_path / "m.onnx")
    onnx.save(convert_float_to_float16(onnx.load(tied(str(tmp_path / "float32.onnx"), vocab, width)),
                                       keep_io_types=True), path)
    return path


def _widened(tmp_path, vocab=64, width=8):
    """(the float16 model's proto, its optimized layout, the float32 copy of its table the layout holds)."""
    path, layout_path = _float16(tmp_path, vocab, width), str(tmp_path / "optimized.onnx")
    write_optimized_layout(path, layout_path)
    proto, layout = onnx.load(path), onnx.load(layout_path, load_external_data=False)
    (widened,) = [t for t in made(proto, layout) if np.prod(t.dims) == vocab * width]
    return proto, layout, widened


def test_a_widened_float16_copy_is_recomputed_as_numpy_widens_the_table(tmp_path):
    vocab, width = 64, 8
    proto, layout, widened = _widened(tmp_path, vocab, width)
    assert widened.data_type == onnx.TensorProto.FLOAT and widened.name.startswith(folding.WIDENED)
    (copy,) = folding.recomputed(proto, layout, [vocab * width], str(tmp_path)).graph.initializer
    (table,) = [numpy_helper.to_array(t) for t in proto.graph.initializer if np.prod(t.dims) == vocab * width]
    assert table.dtype == np.float16 and copy.name == widened.name
    values = numpy_helper.to_array(copy)
    expected = table.astype(np.float32)  # float16 -> float32 is exact: one answer
    assert values.shape == expected.shape and np.array_equal(values.view(np.uint32), expected.view(np.uint32))


def test_a_widened_copy_two_weights_could_be_is_not_recomputed(tmp_path):
    # onnxruntime names W's widening FusedBack_W, or FusedBack_W_token_0 where that name is taken: beside a weight
    # named W_token_0 of W's dims, FusedBack_W_token_0 could be either's, so it is left to the data write
    vocab, width = 64, 8
    proto, layout, widened = _widened(tmp_path, vocab, width)
    (table,) = [t for t in proto.graph.initializer if t.name == widened.name[len(folding.WIDENED):]]
    widened.name += "_token_0"  # as onnxruntime names it where FusedBack_<table> is taken
    (copy,) = folding.recomputed(proto, layout, [vocab * width], str(tmp_path)).graph.initializer
    expected = numpy_helper.to_array(table).astype(np.float32)  # the suffix alone: still the table's widening
    assert copy.name == widened.name and np.array_equal(numpy_helper.to_array(copy).view(np.uint32),
                                                        expected.view(np.uint32))
    other = onnx.TensorProto()
    other.CopyFrom(table)
    other.name = table.name + "_token_0"  # another weight, of the same dims, that the copy could be the widening of
    proto.graph.initializer.append(other)
    assert folding.recomputed(proto, layout, [vocab * width], str(tmp_path)) is None


def test_inspect_of_a_float16_model_writes_no_data_file(tmp_path):
    path = _float16(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_model(path, str(scratch))
    written = sorted(n for n in os.listdir(scratch) if n.startswith("optimized"))
    assert written == ["optimized.onnx", "optimized.onnx.copies.onnx"]
    (copy,) = [c for c in found["runtime_copies"] if str(c.get("view", "")).startswith("widened")]
    assert copy["copy_of"] == found["vocabulary"][0]["table"]  # told by comparing its recomputed values


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
