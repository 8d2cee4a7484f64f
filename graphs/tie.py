"""The tie at run time: a head reads its table through a view onnxruntime can neither fold nor prepack.

When a session loads, onnxruntime prepacks every constant MatMul / Gemm / FusedMatMul weight into a second
buffer in MLAS's packed layout (its default SessionOptions), while a lookup keeps reading the table itself: a
tied table is then held twice. A Reshape of the table to its own shape, with a target computed from a run-time
input, is not a constant, so nothing is folded into a copy or prepacked, and onnxruntime's Reshape aliases its
input: the head reads the one table in place. An initializer also declared as a graph input would do the same,
but changes the model's inputs and onnxruntime warns about it at every load.
"""
import numpy as np
from onnx import TensorProto, helper


def unfolded_view(table, anchor, dims, output, prefix):
    """(nodes, constants {name: int64 array}, value_info) making `output` the initializer `table` (of dims `dims`,
    [vocab, width] for a table) as a tensor onnxruntime computes at run time.

    target = dims + 0 * max(Shape(anchor)): `anchor` is any input with a dim known only at run time (ids,
    hidden), so the sum is never constant; the Reshape then changes nothing but constness."""
    names = {k: prefix + k for k in ("anchor_shape", "anchor_max", "nothing", "zero", "dims", "target")}
    nodes = [
        helper.make_node("Shape", [anchor], [names["anchor_shape"]], name=prefix + "anchor_shape",
                         doc_string=f"the shape of {anchor}: known only at run time"),
        helper.make_node("ReduceMax", [names["anchor_shape"]], [names["anchor_max"]], name=prefix + "anchor_max",
                         doc_string="one number of it, [1]", keepdims=1),
        helper.make_node("Mul", [names["anchor_max"], names["zero"]], [names["nothing"]], name=prefix + "nothing",
                         doc_string="times 0: always [0], but not a constant to onnxruntime"),
        helper.make_node("Add", [names["dims"], names["nothing"]], [names["target"]], name=prefix + "target",
                         doc_string=f"the table's own shape {list(dims)}, computed at run time"),
        helper.make_node("Reshape", [table, names["target"]], [output], name=prefix + "view",
                         doc_string=f"{table} itself (the Reshape aliases it, no copy), but not a constant: "
                                    "onnxruntime neither folds nor prepacks it into a second table"),
    ]
    constants = {names["zero"]: np.zeros(1, np.int64), names["dims"]: np.asarray(dims, np.int64)}
    value_info = [helper.make_tensor_value_info(names["anchor_shape"], TensorProto.INT64, [None]),
                  helper.make_tensor_value_info(names["anchor_max"], TensorProto.INT64, [1]),
                  helper.make_tensor_value_info(names["nothing"], TensorProto.INT64, [1]),
                  helper.make_tensor_value_info(names["target"], TensorProto.INT64, [len(dims)])]
    return nodes, constants, value_info


def viewed_dims(target, producer, constant):
    """The dims a Reshape target computed as unfolded_view computes it always equals (dims + 0 * anything), or
    None. `producer` maps a tensor name to the node that writes it; `constant(name)` is an initializer's values
    (a short int array) or None."""
    add = producer.get(target)
    if add is None or add.op_type != "Add" or len(add.input) != 2:
        return None
    for dims, other in (add.input, add.input[::-1]):
        mul, values = producer.get(other), constant(dims)
        if values is None or values.ndim != 1 or mul is None or mul.op_type != "Mul" or len(mul.input) != 2:
            continue
        if any(z is not None and z.size == 1 and int(z.reshape(-1)[0]) == 0 for z in map(constant, mul.input)):
            return [int(v) for v in values]
    return None
