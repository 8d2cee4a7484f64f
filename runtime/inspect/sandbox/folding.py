"""What onnxruntime's optimizer will make of a model as a session opens, foreseen from its graph: the tensors
constant folding makes of its weights, and the float32 copies the CPU provider makes of float16 ones. The child
(sandbox.child, sandbox.proof) decides from these which session writes the optimized model, and whether with its
data: a guess only chooses the cheaper way, every answer is read from the model onnxruntime wrote. A copy of a
weight that it made is then told by the node it was folded from (folded_from), not by its values."""
import math
import re

from onnx import TensorProto

from graphs.storage import BITS
from runtime.model.graph.ops import MATMULS
from runtime.resident import OWNED_MOST, held_once_written

FOLDED = ("Transpose", "Reshape", "Cast", "Squeeze", "Unsqueeze", "Flatten")  # on a weight: folded at load
HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _nbytes(tensor):
    """The bytes of a TensorProto's data, from its dims and type."""
    return (math.prod(tensor.dims) * BITS.get(tensor.data_type, 64) + 7) // 8


def made_at_load(sizes):
    """Whether the optimized model must be written with its data for the parent to compare a copy's values: where
    any copy is looked for (`sizes` None). A copy of one of `sizes` elements that constant folding makes of a
    weight, or the CPU provider's float32 widening of a float16 / bfloat16 one, is told by its node instead
    (folded_from()), so the graph need not be read to decide it."""
    return sizes is None


from runtime.model.findings.copies import WIDENED  # noqa: E402  (the name onnxruntime gives its widenings)


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


_SAME_BYTES = ("Reshape", "Squeeze", "Unsqueeze", "Flatten")  # the weight's bytes under other dims


def folded_from(proto, layout, sizes):
    """{name: {"of": weight, "view": "transposed", "same", "reshaped" or "widened"}} for each tensor the optimized
    model `layout` (a ModelProto written for its layout: optimized.write_optimized_layout) made of one of `sizes`
    elements, told by the node of `proto` (the model's shell) that constant folding folded it from, whose output
    it is named after: a Transpose of a 2-D weight holds it transposed, a Reshape (Squeeze, Unsqueeze, Flatten, a
    Cast to its own type) its bytes under other dims, and the CPU provider's float32 copy of a float16 / bfloat16
    weight (named after it: WIDENED, and no node's output) its values widened. Each of these ops only moves or
    widens values, so the node says what the copy holds and no value is read: neither the optimized model's data
    (every weight again and each prepacked copy: 1.2 GB for a 0.5 GiB model) nor a copy made again (a 544 MB
    transposed table, serialized and compared, took 2.4 s of a Qwen2.5-shaped export's inspect). None where one
    was made some other way, or in a branch: the caller writes the data then, and the values are compared."""
    from runtime.resident import made
    if sizes is None:
        return None
    weights = {t.name: t for t in proto.graph.initializer}
    producers = {out: node for node in _folded(proto, weights) for out in node.output}
    named = {out for node in proto.graph.node for out in node.output}
    halves = {name: t for name, t in weights.items() if t.data_type in HALF}
    wanted = [t for t in layout.graph.initializer if t.name not in weights and math.prod(t.dims) in set(sizes)]
    if len(wanted) != sum(math.prod(t.dims) in set(sizes) for t in made(proto, layout)):
        return None  # a copy made in a branch: written with the data
    found = {}
    for tensor in wanted:
        node = producers.get(tensor.name)
        if node is not None:
            told = _view(node, weights[node.input[0]], tensor)
        else:
            # a name the model's own nodes give (a folded Mul named "FusedBack_<table>") is not the provider's
            weight = _widening(tensor.name, tensor.dims, halves) if tensor.data_type == TensorProto.FLOAT and \
                tensor.name not in named else None
            told = weight and {"of": weight.name, "view": "widened"}
        if not told:
            return None
        found[tensor.name] = told
    return found


def _view(node, weight, tensor):
    """{"of": the weight's name, "view"} for `tensor`, folded from `node` (one of FOLDED) on `weight`, or None: a
    Transpose other than a 2-D one, a Cast to another type than the weight's or (from half precision) float32."""
    dims, attributes = list(weight.dims), {a.name: a for a in node.attribute}
    to = attributes["to"].i if node.op_type == "Cast" and "to" in attributes else None
    if node.op_type == "Transpose":
        perm = tuple(attributes["perm"].ints) if "perm" in attributes else (1, 0)  # reversed, by default
        view = {(1, 0): "transposed", (0, 1): "same"}.get(perm) if len(dims) == 2 else None
    elif node.op_type in _SAME_BYTES or to == weight.data_type:
        view = "same" if list(tensor.dims) == dims else "reshaped"
    else:
        view = "widened" if weight.data_type in HALF and to == TensorProto.FLOAT else None
    return view and {"of": weight.name, "view": view}


def read_optimized(path, folder, answer):
    """The optimized model a child wrote at `path` (its data in `folder`), read by the checked reader as its
    `answer` says it was written: with its data, or for its layout only (each copy to compare then told by
    folded_from: answer.folded)."""
    from runtime.model.read.model import load
    return load(path, folder, layout_only=not answer.data)
