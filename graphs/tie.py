"""The tie at run time: a head reads its table through a view onnxruntime can neither fold nor prepack.

When a session loads, onnxruntime prepacks every constant MatMul / Gemm / FusedMatMul weight into a second
buffer in MLAS's packed layout (its default SessionOptions), while a lookup keeps reading the table itself: a
tied table is then held twice. A Reshape of the table to its own shape, with a target computed from a run-time
input, is not a constant, so nothing is folded into a copy or prepacked, and onnxruntime's Reshape aliases its
input: the head reads the one table in place. An initializer also declared as a graph input would do the same,
but changes the model's inputs and onnxruntime warns about it at every load.

Why the target is made from the anchor's *values*, not its shape: onnxruntime folds Shape of a tensor whose dims
it knows at load (a static-shape export, `ids [2, 5]`, or a session's free-dimension overrides), and constant
folding then reaches the Reshape, which becomes a second table. No shape inference knows a tensor's values, and
onnxruntime folds only nodes whose inputs are all constant, so a zero computed from one element of the anchor
is never a constant, whatever the shapes.
"""
import numpy as np
from onnx import TensorProto, helper


def unfolded_view(table, anchor, dims, output, prefix, anchor_type=None):
    """(nodes, constants {name: int64 array}, value_info) making `output` the initializer `table` (of dims `dims`,
    [vocab, width] for a table) as a tensor onnxruntime computes at run time.

    target = dims + 0 * sum(Cast(first element of `anchor` != 0)): `anchor` is any tensor computed at run time
    (ids, hidden) of any dtype and shape, empty included (the sum of no element is 0). The element goes through
    bool (NaN and inf too), so the product is an integer 0; the Reshape then changes nothing but constness.
    `anchor_type` (the anchor's TensorProto type, if known) adds the value_info of its two views."""
    names = {k: prefix + k for k in ("anchor_flat", "anchor_first", "anchor_bool", "anchor_int", "anchor_sum",
                                     "nothing", "zero", "one", "flat", "dims", "target")}
    n = names
    nodes = [
        helper.make_node("Reshape", [anchor, n["flat"]], [n["anchor_flat"]], name=prefix + "anchor_flat",
                         doc_string=f"{anchor} as one row (an alias, no copy)"),
        helper.make_node("Slice", [n["anchor_flat"], n["zero"], n["one"]], [n["anchor_first"]],
                         name=prefix + "anchor_first",
                         doc_string="its first element ([1], or [0] when empty): a value, known only at run time"),
        helper.make_node("Cast", [n["anchor_first"]], [n["anchor_bool"]], name=prefix + "anchor_bool",
                         to=TensorProto.BOOL, doc_string="as a bool: defined for every type, NaN included"),
        helper.make_node("Cast", [n["anchor_bool"]], [n["anchor_int"]], name=prefix + "anchor_int",
                         to=TensorProto.INT64, doc_string="0 or 1"),
        helper.make_node("ReduceSum", [n["anchor_int"]], [n["anchor_sum"]], name=prefix + "anchor_sum",
                         keepdims=1, doc_string="[1] always: 0 or 1"),
        helper.make_node("Mul", [n["anchor_sum"], n["zero"]], [n["nothing"]], name=prefix + "nothing",
                         doc_string="times 0: always [0], but not a constant to onnxruntime"),
        helper.make_node("Add", [n["dims"], n["nothing"]], [n["target"]], name=prefix + "target",
                         doc_string=f"the table's own shape {list(dims)}, computed at run time"),
        helper.make_node("Reshape", [table, n["target"]], [output], name=prefix + "view",
                         doc_string=f"{table} itself (the Reshape aliases it, no copy), but not a constant: "
                                    "onnxruntime neither folds nor prepacks it into a second table"),
    ]
    constants = {n["zero"]: np.zeros(1, np.int64), n["one"]: np.ones(1, np.int64),
                 n["flat"]: np.full(1, -1, np.int64), n["dims"]: np.asarray(dims, np.int64)}
    value_info = [] if anchor_type is None else [helper.make_tensor_value_info(n["anchor_flat"], anchor_type, [None]),
                                                 helper.make_tensor_value_info(n["anchor_first"], anchor_type, [None])]
    value_info += [helper.make_tensor_value_info(n["anchor_bool"], TensorProto.BOOL, [None]),
                  helper.make_tensor_value_info(n["anchor_int"], TensorProto.INT64, [None]),
                  helper.make_tensor_value_info(n["anchor_sum"], TensorProto.INT64, [1]),
                  helper.make_tensor_value_info(n["nothing"], TensorProto.INT64, [1]),
                  helper.make_tensor_value_info(n["target"], TensorProto.INT64, [len(dims)])]
    return nodes, constants, value_info


def viewed_dims(target, producer, constant):
    """The dims a Reshape target computed as unfolded_view computes it always equals (dims + 0 * anything), or
    None. `producer` maps a tensor name to the node that writes it; `constant(name)` is an initializer's values
    (a short int array) or None. Views written by earlier versions (0 * a Shape's maximum) have the same form."""
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
