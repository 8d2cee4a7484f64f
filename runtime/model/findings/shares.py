"""What the vocabulary line says about a table beyond its bytes: its share of the parameters as Hugging Face counts
them, the constant its looked-up rows are multiplied by (Gemma's sqrt(width)), and whether it holds tokens or
positions."""
import math

from runtime.model.graph.constants import constant
from runtime.model.graph.ops import CACHE_INPUTS, QUANT_INPUTS
from runtime.model.graph.walk import lookup_ids
from runtime.model.read.model import CODES, FLOATS

_ROW_PASS = ("Slice", "Reshape", "Cast", "Identity")  # between a lookup and the Mul that scales its rows


def parameters(model, tables, heads, pairs):
    """(count, what was counted): float weights and quantized codes, each table or head at vocab x width (padding
    and two-codes-a-byte packing undone), a head that duplicates its table (or holds it quantized) once; scales,
    zero points, rotary caches and integer constants (shapes, masks) not counted."""
    skipped = {p.head for p in pairs if p.relation in ("duplicate", "transposed_duplicate", "quantized_copy")}
    for node in model.proto.graph.node:
        for i in QUANT_INPUTS.get(node.op_type, ()) + CACHE_INPUTS.get(node.op_type, ()):
            if i < len(node.input):
                skipped.add(node.input[i])
    for entry in tables + heads:  # a scale found past the op (MatMulInteger's) is not an input of it
        quant = entry.quant
        if quant is not None:
            skipped.update(n for n in (quant.scale, quant.zero_point) if n)
    logical = {e.initializer: e.vocab * e.width for e in tables + heads if e.quant or
               e.format == "int4"}
    decoded = {n.input[0] for n in model.proto.graph.node if n.op_type == "DequantizeLinear" and n.input}
    count = 0
    for tensor in model.tensors.values():
        if tensor.name in skipped:
            continue
        if tensor.name in logical:
            count += logical[tensor.name]
        elif tensor.data_type in FLOATS or (tensor.data_type in CODES and tensor.name in decoded):
            count += tensor.elements
    return count, ("float weights and quantized codes (a duplicated head once; scales, zero points, rotary caches "
                   "and integer constants not counted)")


def scalar_constant(name, producer, model):
    """The value of a scalar float constant (an initializer or a Constant node), or None."""
    values = constant(name, producer, model, most=1)
    return float(values[0]) if values is not None and values.size == 1 and values.dtype.kind not in "iub" else None  # bfloat16 too


def row_scale(model, table, producer, consumers):
    """(constant, whether it is sqrt(width) to bfloat16's precision) when the looked-up rows are multiplied by a
    scalar constant (past a Slice, Reshape or Cast), else (None, None)."""
    out = table.node.output[0] if table.node.output else None
    for _ in range(4):
        readers = [r for r in consumers.get(out, []) if r.op_type != "Shape"]  # a Shape reads no values
        if len(readers) != 1:
            return None, None
        node = readers[0]
        if node.op_type == "Mul":
            other = [n for n in node.input if n != out]
            value = scalar_constant(other[0], producer, model) if len(other) == 1 else None
            if value is None:
                return None, None
            return value, abs(value / math.sqrt(table.width) - 1) <= 2**-8
        if node.op_type not in _ROW_PASS or not node.output:
            return None, None
        out = node.output[0]
    return None, None


def kind(model, table, producer, most=256):
    """"position" when what feeds the lookup comes from a graph input named for positions or is computed by a Range
    or CumSum (positions counted from the mask); else "token"."""
    inputs = {v.name for v in model.proto.graph.input}
    seen, todo = set(), [lookup_ids(table)] if table.ids or len(table.node.input) > 1 else []
    while todo and len(seen) < most:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in inputs and "position" in name.lower():
            return "position"
        node = producer.get(name)
        if node is not None:
            if node.op_type in ("Range", "CumSum"):
                return "position"
            todo.extend(n for n in node.input if n)
    return "token"
