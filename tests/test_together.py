"""graphs.together and graphs.arrays: what they write is the arrays' bytes, read back by onnx, each distinct tensor
stored once; a memory map's bytes copied file to file."""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphs.arrays import file_range, write_array
from graphs.together import save_together

ROWS, WIDTH = 512, 64  # 128 KiB a tensor: its first and last 4 KiB are 1/16 of it each


def _model(arrays):
    """A model holding `arrays` {name: float32 array} as initializers, each summed into an output so none is dead."""
    inits = [numpy_helper.from_array(a, name) for name, a in arrays.items()]
    nodes = [helper.make_node("ReduceSum", [name], [f"{name}_sum"], keepdims=0) for name in arrays]
    outputs = [helper.make_tensor_value_info(f"{name}_sum", TensorProto.FLOAT, []) for name in arrays]
    return helper.make_model(helper.make_graph(nodes, "g", [], outputs, inits),
                             opset_imports=[helper.make_opsetid("", 13)])


def _stored(path):
    """{initializer name: (location, offset)} of the model at `path`, its data not read."""
    model = onnx.load(path, load_external_data=False)
    return {t.name: tuple(e.value for e in t.external_data if e.key in ("location", "offset"))
            for t in model.graph.initializer}


def test_tensors_alike_at_both_ends_are_stored_apart_and_a_repeated_one_once(tmp_path):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    b = a.copy()
    b[ROWS // 2, 3] += 1.0  # the same first and last bytes, another value in the middle
    c = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    arrays = {"a": a, "b": b, "c": c, "a_again": a.copy(), "b_again": b.copy()}
    save_together([("m.onnx", _model(arrays), None)], tmp_path / "out")
    path = tmp_path / "out" / "m.onnx"
    where = _stored(path)
    assert where["a"] == where["a_again"] and where["b"] == where["b_again"]
    assert len({where["a"], where["b"], where["c"]}) == 3
    loaded = onnx.load(path)  # onnx's own reader, data and all
    for t in loaded.graph.initializer:
        assert numpy_helper.to_array(t).tobytes() == arrays[t.name].tobytes(), t.name


def test_the_same_tensor_in_two_files_is_stored_once_for_both(tmp_path):
    rng = np.random.default_rng(8)
    table = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    other = table.copy()
    other[-1, -1] = -other[-1, -1]  # differs in its last bytes only
    save_together([("a.onnx", _model({"t": table}), None), ("b.onnx", _model({"t": table, "u": other}), None)],
                  tmp_path / "out")
    first, second = (_stored(tmp_path / "out" / name) for name in ("a.onnx", "b.onnx"))
    assert first["t"] == second["t"] != second["u"]
    assert os.path.getsize(tmp_path / "out" / "model.data") < 3 * table.nbytes


def _mapped_file(tmp_path, array, lead=123):
    path = tmp_path / "source.bin"
    path.write_bytes(b"x" * lead + array.tobytes())
    return np.memmap(path, dtype=array.dtype, mode="r", offset=lead, shape=array.shape)


class _Shell:
    name = "t"

    def __init__(self, shape):
        self.dims = list(shape)


def test_a_mapped_array_and_its_views_are_written_as_their_bytes(tmp_path):
    array = np.arange(1000 * 37, dtype=np.float32).reshape(1000, 37)
    mapped = _mapped_file(tmp_path, array)
    views = {"whole": (mapped, array), "rows": (mapped[10:500], array[10:500]), "one row": (mapped[3], array[3]),
             "transposed": (mapped.T, array.T), "columns": (mapped[:, 2:5], array[:, 2:5])}
    for what, (view, expected) in views.items():
        out = tmp_path / "out.bin"
        with open(out, "wb") as f:
            f.write(b"ab")
            write_array(f, view, _Shell(view.shape))
            f.write(b"cd")
        assert out.read_bytes() == b"ab" + np.ascontiguousarray(expected).tobytes() + b"cd", what
    # the contiguous ones are a range of the file, copied by the kernel; the strided ones are not
    path, offset, length = file_range(mapped[10:500])
    assert (os.fspath(path), offset, length) == (os.fspath(tmp_path / "source.bin"), 123 + 10 * 37 * 4, 490 * 37 * 4)
    assert file_range(mapped.T) is None and file_range(array) is None
