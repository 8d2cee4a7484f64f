"""What onnxruntime's optimizer will make of a model as a session opens, foreseen from its graph: the tensors
constant folding makes of its weights, and the float32 copies the CPU provider makes of float16 ones. The child
(sandbox.child, sandbox.proof) decides from these which session writes the optimized model, and whether with its
data: a guess only chooses the cheaper way, every answer is read from the model onnxruntime wrote."""
import math
import re

from onnx import TensorProto, helper

from graphs.storage import BITS
from runtime.model.graph.ops import MATMULS
from runtime.resident import OWNED_MOST, held_once_written

FOLDED = ("Transpose", "Reshape", "Cast", "Squeeze", "Unsqueeze", "Flatten")  # on a weight: folded at load
HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
INLINE_MOST = 2**30  # recomputed copies held inline in one protobuf (2 GiB at most): past this, the data written


def _nbytes(tensor):
    """The bytes of a TensorProto's data, from its dims and type."""
    return (math.prod(tensor.dims) * BITS.get(tensor.data_type, 64) + 7) // 8


def made_at_load(proto, sizes):
    """Whether the optimized model must be written with its data for the parent to compare a copy's values: where
    any copy is looked for (`sizes` None). A copy of one of `sizes` elements that constant folding makes of a
    weight, or the CPU provider's float32 widening of a float16 / bfloat16 one, is recomputed instead
    (recomputed()); `proto` is the model's shell, whose graph decides it."""
    return sizes is None


WIDENED = "FusedBack_"  # onnxruntime's FuseInitializersTransformer: the float32 copy of a half-precision weight
# the CPU provider's inserted Cast read, named "FusedBack_" + the weight's name (a suffix added if that is taken)


def _widening(name, dims, halves):
    """The half-precision initializer of `halves` {name: TensorProto} whose widened copy the tensor `name` of
    `dims` is (WIDENED + its name, and its dims), or None, also where two could be (`W` and `W_token_0`)."""
    if not name.startswith(WIDENED):
        return None
    rest = name[len(WIDENED):]
    found = {weight for weight in (rest, re.sub(r"_token_[0-9]+$", "", rest))
             if weight in halves and list(halves[weight].dims) == list(dims)}
    return halves[found.pop()] if len(found) == 1 else None  # two that could be it: the data is written instead


def _folded(proto, initializers):
    """The nodes of FOLDED in `proto`'s main graph that constant folding will fold: the first input one of
    `initializers`, each other an initializer or a Constant node's output (a Reshape to a shape computed at run
    time, as --retie's run-time view is, stays a node)."""
    constant = set(initializers) | {out for node in proto.graph.node if node.op_type == "Constant"
                                    for out in node.output}
    return [node for node in proto.graph.node if node.op_type in FOLDED and node.input and
            node.input[0] in initializers and all(not name or name in constant for name in node.input[1:])]


def folds_held(proto):
    """Whether constant folding will make a tensor that writing the layout in a measured session would leave held
    past OWNED_MOST (resident.owned_bytes): one of FOLDED on such an initializer of the main graph, below
    MAPPED_ALONE (held_once_written: genai int4's 14 MiB Reshape of its table's codes) or read by a matmul, whose
    kernel prepacks it (Optimum's Transpose of the tied table for the head)."""
    nbytes = {t.name: _nbytes(t) for t in proto.graph.initializer}
    weights = {node.input[facts.weight] for node in proto.graph.node
               for op, facts in MATMULS.items() if node.op_type == op and len(node.input) > facts.weight}
    return any(nbytes[n.input[0]] > OWNED_MOST and (held_once_written(nbytes[n.input[0]]) or
                                                    weights.intersection(n.output))
               for n in _folded(proto, nbytes))


def inline_bytes(proto):
    """The bytes of the tensors `proto`'s main graph holds in its protobuf (its initializers stored inline, and its
    Constant nodes'), which onnxruntime copies into memory of its own: a session that writes its optimized model
    serializes them once more (resident.owned_bytes). A model's shell holds its large inline tensors as external
    data in its own file (read.wire), mapped like any other."""
    stored = sum(_nbytes(t) for t in proto.graph.initializer if t.data_location != TensorProto.EXTERNAL)
    return stored + sum(len(a.t.raw_data) for node in proto.graph.node if node.op_type == "Constant"
                        for a in node.attribute if a.type == a.TENSOR)


def half_bytes(proto):
    """The bytes of the float16 and bfloat16 initializers of `proto`'s main graph (the CPU provider's float32
    copies of them are twice that)."""
    return sum(2 * math.prod(t.dims) for t in proto.graph.initializer if t.data_type in HALF)


def copies_path(layout_path):
    """Where recomputed() copies of the optimized model written for its layout at `layout_path` are saved."""
    return layout_path + ".copies.onnx"


def recomputed(proto, layout, sizes, folder):
    """A model holding, as its initializers, the values of each tensor the optimized model `layout` (a ModelProto
    written for its layout: runner.write_optimized_layout) made of one of `sizes` elements, under its name, each
    recomputed by onnxruntime from the node of `proto` (the model's shell; its data in `folder`) that constant
    folding folded it from: a Transpose, Reshape or Cast of a weight (_folded), whose output the folded tensor is
    named after; or, for the CPU provider's float32 copy of a float16 / bfloat16 weight (named after it: WIDENED),
    from a Cast to float32 of that weight, as the provider's inserted Cast. So the parent compares a copy's values
    without the optimized model's data being written (every weight again and each prepacked copy: 1.2 GB for a
    0.5 GiB model). None where one of them was made some other way, or they are too large to hold inline: the
    caller writes the data then."""
    from onnx import numpy_helper

    from runtime.resident import made
    from runtime.runner import open_session, read_data_from, session_options
    counts = {t.name: math.prod(t.dims) for t in proto.graph.initializer}
    producers = {out: node for node in _folded(proto, counts) for out in node.output}
    halves = {t.name: t for t in proto.graph.initializer if t.data_type in HALF}
    wanted = [t for t in made(proto, layout) if math.prod(t.dims) in set(sizes or ())]
    for t in wanted:  # a widened copy: the Cast the CPU provider inserted and folded, made again
        weight = None if t.name in producers or t.data_type != TensorProto.FLOAT else _widening(t.name, t.dims, halves)
        if weight is not None:
            producers[t.name] = helper.make_node("Cast", [weight.name], [t.name], to=TensorProto.FLOAT)
    main = {id(t) for t in layout.graph.initializer}  # a copy made in a branch is written with the data
    if sizes is None or any(id(t) not in main or t.name not in producers for t in wanted) or \
            sum(_nbytes(t) for t in wanted) > INLINE_MOST:
        return None
    constants = {t.name: t for t in proto.graph.initializer}
    makers = {out: node for node in proto.graph.node if node.op_type == "Constant" for out in node.output}
    values = []
    for tensor in wanted:
        node = producers[tensor.name]
        used = [name for name in node.input if name]
        graph = helper.make_graph(
            [makers[name] for name in used if name in makers] + [node], "folded",
            [], [helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))],
            [constants[name] for name in used if name in constants])
        model = helper.make_model(graph, opset_imports=proto.opset_import, ir_version=proto.ir_version)
        session = open_session(model.SerializeToString(), read_data_from(session_options(), folder))
        values.append(numpy_helper.from_array(session.run(None, {})[0], tensor.name))
        del session
    return helper.make_model(helper.make_graph([], "recomputed", [], [], values), opset_imports=proto.opset_import,
                             ir_version=proto.ir_version)


def read_optimized(path, folder, answer):
    """The optimized model a child wrote at `path` (its data in `folder`), read by the checked reader as its
    `answer` says it was written: with its data, or for its layout only, each copy recomputed() beside it then
    read from there (the same name, dims and type, and its values)."""
    from runtime.model.read.model import load
    optimized = load(path, folder, layout_only=not answer.get("data", True))
    if answer.get("recomputed"):
        copies = load(copies_path(path), folder)
        for name, tensor in copies.tensors.items():
            held = optimized.tensors.get(name)
            if held is None or (held.dims, held.type_name) != (tensor.dims, tensor.type_name):
                raise ValueError(f"{name}: a recomputed copy the optimized model does not hold as it is")
            optimized.tensors[name] = tensor
    return optimized
