"""Whether a float table's lookup could read the block codes a MatMulNBits head holds of the same values
(--retie --lookup-from-head): decided once, where the pair is found (relations.relate), and read by name after."""
from typing import NamedTuple

from onnx import TensorProto

from runtime.model.graph.quantized import attribute

FLAG = "--lookup-from-head"

REVERSE = ("the lookup holds the quantized copy and the head the float one: a share would keep the lookup's codes "
           "and quantize the head the logits rest on (each of its weights moved by up to a quantization step); "
           "left as it is")

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)  # the types GatherBlockQuantized writes its rows in here


class HeadLookup(NamedTuple):
    """A float table / quantized head pair's answer: `why_not` None where --lookup-from-head can rewrite it."""
    why_not: str | None

    @property
    def possible(self):
        return self.why_not is None


def why_not(model, table, head):
    """None where the Gather of float `table` can read `head`'s MatMulNBits codes (GatherBlockQuantized on the
    [N, blocks, blob] codes, its rows in the table's own type), else why not in one line."""
    q, tensors = head.quant, model.tensors
    if head.node.op_type != "MatMulNBits" or q is None or q.scale not in tensors or len(head.stored_dims) != 3:
        return f"its head is a {head.node.op_type}, not MatMulNBits block codes"
    if table.node.op_type != "Gather" or set(table.views) - {"Transpose"} or attribute(table.node, "axis", 0):
        views = ", ".join(table.views) or "no view"
        return f"its lookup is a {table.node.op_type} through {views}, not a Gather of the table's rows"
    kind, scales = tensors[table.initializer].data_type, tensors[q.scale].data_type
    if kind not in _FLOATS or scales != kind:
        return (f"a {table.format} table beside {TensorProto.DataType.Name(scales).lower()} scales: the rows "
                "would change type")
    if q.bits not in (4, 8):
        return f"{q.bits}-bit codes: GatherBlockQuantized reads 4 or 8"
    if q.zero_point and (q.zero_point not in tensors or tensors[q.zero_point].data_type != TensorProto.UINT8):
        return "its zero points are not uint8 codes"
    block = attribute(head.node, "block_size", 0)
    if not block or head.stored_dims[1] * block != table.width:
        return "the head's codes are padded past the width to whole blocks"
    return None
