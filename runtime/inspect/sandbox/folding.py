"""What onnxruntime's optimizer will make of a model as a session opens, foreseen from its graph: the tensors
constant folding makes of its weights, and the float32 copies the CPU provider makes of float16 ones. The child
(sandbox.child, sandbox.proof) decides from these which session writes the optimized model, and whether with its
data: a guess only chooses the cheaper way, every answer is read from the model onnxruntime wrote."""
import math

from onnx import TensorProto

from graphs.storage import BITS
from runtime.resident import OWNED_MOST, held_once_written

FOLDED = ("Transpose", "Reshape", "Cast", "Squeeze", "Unsqueeze", "Flatten")  # on a weight: folded at load
HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def made_at_load(proto, sizes):
    """Whether the optimizer will make a tensor of one of `sizes` elements (None: any) whose values the parent
    compares: one of FOLDED on such an initializer of `proto`'s main graph (genai's tied head, which the lookup
    reads through a Transpose), or a float16 / bfloat16 one the CPU provider widens (a table-shaped head)."""
    if sizes is None:
        return True
    counts = {t.name: math.prod(t.dims) for t in proto.graph.initializer}
    return any(counts[node.input[0]] in sizes for node in _folded(proto, counts)) or \
        any(t.data_type in HALF and math.prod(t.dims) in sizes for t in proto.graph.initializer)


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
    past OWNED_MOST (resident.owned_bytes, held_once_written): one of FOLDED on such an initializer of the main
    graph (genai int4's 14 MiB Reshape of its table's codes)."""
    nbytes = {t.name: (math.prod(t.dims) * BITS.get(t.data_type, 64) + 7) // 8 for t in proto.graph.initializer}
    return any(nbytes[n.input[0]] > OWNED_MOST and held_once_written(nbytes[n.input[0]])
               for n in _folded(proto, nbytes))


def half_bytes(proto):
    """The bytes of the float16 and bfloat16 initializers of `proto`'s main graph (the CPU provider's float32
    copies of them are twice that)."""
    return sum(2 * math.prod(t.dims) for t in proto.graph.initializer if t.data_type in HALF)
