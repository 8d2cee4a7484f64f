"""Quantized tables and heads read back as values, whatever layout holds them: ONNX INT4 / UINT4 / INT8 / UINT8
stored [vocab, width] or [width, vocab] with a per-tensor, per-axis or blocked scale and zero point (what
DequantizeLinear, GatherBlockQuantized, MatMulInteger and the other integer matmuls read), and onnxruntime's uint8
block layout [vocab, blocks, block * bits / 8] (MatMulNBits, GatherBlockQuantized on 3-D codes). Decoded a chunk of
tokens at a time, so two layouts of one table are told from two tables, and a quantized head from the float table
it was made from."""
from dataclasses import dataclass

import numpy as np
from onnx import AttributeProto, TensorProto

from runtime.model.graph.ops import MATMULS
from runtime.model.read.model import BYTE_CODES, CODES, label
from runtime.model.read.text import InspectError

_VALUES_AT_ONCE = 8 * 2**20  # float64 values decoded at a time

_SIGNED = {TensorProto.INT4: True, TensorProto.UINT4: False, TensorProto.INT8: True, TensorProto.UINT8: False}

_UNPACK_WHOLE = 64 * 2**20  # a packed 4-bit tensor read across its rows is unpacked whole only below this


@dataclass(frozen=True)
class Quant:
    """How to decode a quantized table or head: the codes' initializer, its scale and zero point initializers,
    the bits per code, `blocks` (the uint8 block layout) or not; for the ONNX layout the quantized axis of the
    stored dims and the columns per scale along it (None: one per index of that axis, or one for the tensor), and
    which stored axis counts tokens; `width` the true width (a padded block layout holds more columns)."""
    codes: str
    scale: str | None
    zero_point: str | None
    bits: int
    blocks: bool
    axis: int = 1
    block: int | None = None
    tokens_axis: int = 0
    width: int = 0
    default_zero: int = 0  # the zero point when none is stored (ONNX layout)


def _nibbles(raw, start, stop, signed):
    """4-bit codes start..stop of a flat packed run (the first in the low nibble), as int16."""
    data = np.asarray(raw[start // 2:(stop + 1) // 2], np.uint8)
    codes = np.empty(2 * len(data), np.int16)
    codes[0::2], codes[1::2] = data & 15, data >> 4
    codes = codes[start % 2:start % 2 + stop - start]
    return np.where(codes >= 8, codes - 16, codes) if signed else codes


def _stored_codes(tensor, t0, t1, tokens_axis):
    """Codes of tokens t0..t1 as int16 [tokens, width] (ONNX layout), or None when they cannot be read cheaply."""
    signed = _SIGNED.get(tensor.data_type)
    if signed is None or len(tensor.dims) != 2:
        return None
    rows, cols = tensor.dims
    if tensor.data_type in BYTE_CODES:
        values = tensor.values()
        part = values[t0:t1] if tokens_axis == 0 else values[:, t0:t1].T
        return part.astype(np.int16)
    raw = tensor.raw()
    if tokens_axis == 0:
        return _nibbles(raw, t0 * cols, t1 * cols, signed).reshape(t1 - t0, cols)
    if rows * cols > _UNPACK_WHOLE:
        return None
    return _nibbles(raw, 0, rows * cols, signed).reshape(rows, cols)[:, t0:t1].T


def _expand(array, q, t0, t1):
    """A scale or zero point array (scalar, per axis, or blocked) as float64 [t1 - t0, width], tokens first: each
    element's own entry picked by index, so only this chunk's entries are read (never the whole array per chunk)."""
    array = np.asarray(array)
    if array.size == 1:
        return np.full((t1 - t0, q.width), float(array.reshape(-1)[0]))
    tokens, columns = np.arange(t0, t1)[:, None], np.arange(q.width)[None, :]
    index = [tokens, columns] if q.tokens_axis == 0 else [columns, tokens]  # each element's (row, column) as stored
    if array.ndim == 1:
        return np.broadcast_to(array[index[q.axis]].astype(np.float64), (t1 - t0, q.width))
    if q.block:
        index[q.axis] = index[q.axis] // q.block
    return array.reshape(array.shape[0], -1)[index[0], index[1]].astype(np.float64)


def _block_codes(model, q, t0, t1):
    """(codes int16 [tokens, width], scales, zero points float64 [tokens, width]) of the uint8 block layout."""
    tensor = model.tensors[q.codes]
    vocab, nblocks = tensor.dims[0], tensor.dims[1]
    raw = np.asarray(tensor.values()[t0:t1], np.uint8).reshape(t1 - t0, -1)
    if q.bits == 4:
        codes = np.empty((t1 - t0, 2 * raw.shape[1]), np.int16)
        codes[:, 0::2], codes[:, 1::2] = raw & 15, raw >> 4
    else:
        codes = raw.astype(np.int16)
    block = codes.shape[1] // nblocks
    scales = model.tensors[q.scale].values().reshape(vocab, nblocks)[t0:t1]  # this chunk's rows only
    if q.zero_point in model.tensors:
        zp = model.tensors[q.zero_point]
        points = zp.values().reshape(vocab, -1)[t0:t1]
        if zp.data_type == TensorProto.UINT8 and q.bits == 4:  # two a byte, rows padded to whole bytes
            points = np.stack([points & 15, points >> 4], axis=-1).reshape(t1 - t0, -1)
        points = points[:, :nblocks]
    else:
        points = np.full_like(scales, 2 ** (q.bits - 1))
    expand = lambda a: np.repeat(np.asarray(a, np.float64), block, axis=1)[:, :q.width]
    return codes[:, :q.width], expand(scales), expand(points)


def decoded(model, q, t0, t1):
    """(values, scales) float64 [t1 - t0, width] of tokens t0..t1: value = (code - zero point) x scale; None when
    the layout cannot be read (a scale that is not an initializer, packed codes in typed fields)."""
    if q.scale not in model.tensors:
        return None
    if q.blocks:
        codes, scales, points = _block_codes(model, q, t0, t1)
    else:
        tensor = model.tensors[q.codes]
        try:
            codes = _stored_codes(tensor, t0, t1, q.tokens_axis)
        except (ValueError, TypeError):
            return None
        if codes is None:
            return None
        scale = model.tensors[q.scale]
        scales = _expand(scale.values(), q, t0, t1)
        zp = model.tensors.get(q.zero_point)
        points = np.full_like(scales, q.default_zero) if zp is None else _expand(_integers(zp), q, t0, t1)
    return (codes - points) * scales, scales


def _integers(tensor):
    values = tensor.values()
    if values is None:  # a packed 4-bit zero point
        return _nibbles(tensor.raw(), 0, tensor.elements, _SIGNED[tensor.data_type]).reshape(tensor.dims)
    return values


def chunks(vocab, width):
    """[(t0, t1)]: the token ranges a table of `width` is decoded in, each within _VALUES_AT_ONCE values."""
    step = max(1, _VALUES_AT_ONCE // max(1, 3 * width))
    return [(t0, min(vocab, t0 + step)) for t0 in range(0, vocab, step)]


def same_quantized(model, a, b, vocab):
    """Whether two quantized entries hold the same codes and scales (the same values and the same scale for every
    element: code = value / scale), whatever their layouts; None when either cannot be read."""
    if a.width != b.width:
        return False
    for t0, t1 in chunks(vocab, a.width):
        x, y = decoded(model, a, t0, t1), decoded(model, b, t0, t1)
        if x is None or y is None:
            return None
        if not (np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])):
            return False
    return True


def gap(model, values, q, vocab):
    """The largest |float value - decoded value| in units of the element's scale, for a float table `values`
    ([vocab, width], rows are tokens) against quantized entry `q`; None when `q` cannot be read."""
    worst = 0.0
    for t0, t1 in chunks(vocab, q.width):
        found = decoded(model, q, t0, t1)
        if found is None:
            return None
        rows = np.asarray(values[t0:t1], np.float64)
        if rows.shape != found[0].shape:
            return None
        worst = max(worst, float(np.max(steps(np.abs(rows - found[0]), found[1]), initial=0.0)))
    return worst


def steps(change, scales):
    """`change` in units of `scales`, element by element: 0 where both are 0 (a row a quantizer zeroed whole, as
    Gemma's padding row), inf where only the scale is (no step can make that change), never NaN."""
    scales = np.abs(scales)
    out = np.where(change == 0, 0.0, np.inf)
    return np.divide(change, scales, out=out, where=scales > 0)


def gap_between(model, a, b, vocab):
    """The largest |a's value - b's value| in units of their mean scale ((scale_a + scale_b) / 2, element by
    element), for two quantized entries of one [vocab, width]: two roundings of the same floats lie within it
    (each within half its own scale); None when either cannot be read, or when every scale is the same (one
    scale rounds the same floats to the same codes: codes that differ then belong to another table)."""
    if a.width != b.width:
        return None
    worst, same_scales = 0.0, True
    for t0, t1 in chunks(vocab, a.width):
        x, y = decoded(model, a, t0, t1), decoded(model, b, t0, t1)
        if x is None or y is None or x[0].shape != y[0].shape:
            return None
        worst = max(worst, float(np.max(np.abs(x[0] - y[0]) / ((x[1] + y[1]) / 2))))
        same_scales = same_scales and np.array_equal(x[1], y[1])
    return None if same_scales else worst


def attribute(node, name, default=None):
    """A node's int attribute by name, or `default` when it has none. One of another type (a string, a float, an
    untyped or reference attribute) is an InspectError: every attribute read here is an INT in a valid model."""
    for a in node.attribute:
        if a.name != name:
            continue
        if a.ref_attr_name or a.type != AttributeProto.INT:
            kind = f"a reference to {a.ref_attr_name!r}" if a.ref_attr_name else AttributeProto.AttributeType.Name(a.type)
            raise InspectError(f"{node.op_type} node {label(node)!r}: attribute {name} is {kind}, not an INT: not a valid "
                               "ONNX model")
        return a.i
    return default


def _input(node, i):
    return node.input[i] if len(node.input) > i and node.input[i] else None


def integer_quant(node, codes, flipped, width, producer, consumers, model):
    """The Quant of an integer matmul's weight `codes` (stored [width, vocab] unless `flipped`): its scale is an
    input of the op, or (MatMulInteger) the initializer its output is multiplied by."""
    scale_at, zero_at = MATMULS[node.op_type].scale, MATMULS[node.op_type].zero_point  # scale None: past the op
    scale = _input(node, scale_at) if scale_at is not None else _scale_after(node, producer, consumers, model)
    return Quant(codes, scale, _input(node, zero_at), 8, False, axis=1 - flipped, tokens_axis=1 - flipped,
                 width=width)


def _scale_after(node, producer, consumers, model, operand=1):
    """The scale of MatMulInteger's weight (`operand` 1) or of its A (`operand` 0, when A is looked-up codes):
    quantize_dynamic multiplies its (cast) output by a_scale x b_scale, in that order, b_scale an initializer;
    None where the graph does not say."""
    out = node.output[0] if node.output else None
    for _ in range(2):  # the Mul, or a Cast then the Mul
        nexts = consumers.get(out, [])
        if len(nexts) != 1:
            return None
        step = nexts[0]
        if step.op_type == "Mul":
            for other in (n for n in step.input if n != out):
                if other in model.tensors:
                    return other if operand == 1 else None
                maker = producer.get(other)
                if maker is None or maker.op_type != "Mul" or len(maker.input) != 2:
                    return None
                found = [n for n in maker.input if n in model.tensors]
                if len(found) == 2:  # both constant: the product's first is A's scale, its second B's
                    return maker.input[operand]
                return found[0] if len(found) == 1 and operand == 1 else None
            return None
        if step.op_type != "Cast" or not step.output:
            return None
        out = step.output[0]
    return None


def gathered_quant(model, codes, node, flipped, width, producer, consumers):
    """The Quant of integer codes a Gather looks rows up from and that are decoded after the lookup (onnxruntime's
    quantize_dynamic with Gather quantized): a DequantizeLinear of the rows with one scale for the tensor, or
    MatMulInteger reading them as its A (its a_zero_point, and A's scale in the product its output is multiplied
    by); None otherwise."""
    out = node.output[0] if node.output else None
    readers = consumers.get(out, [])
    if len(readers) != 1 or model.tensors[codes].data_type not in BYTE_CODES:
        return None
    reader = readers[0]
    if reader.op_type == "DequantizeLinear" and reader.input[0] == out:
        scale, zero_point = _input(reader, 1), _input(reader, 2)
    elif reader.op_type == "MatMulInteger" and reader.input[0] == out:
        scale, zero_point = _scale_after(reader, producer, consumers, model, operand=0), _input(reader, 2)
    else:
        return None
    if scale not in model.tensors or model.tensors[scale].elements != 1 or (
            zero_point is not None and (zero_point not in model.tensors or model.tensors[zero_point].elements != 1)):
        return None  # a scale per row or column of the rows looked up: not one this reads
    return Quant(codes, scale, zero_point, 8, False, tokens_axis=1 if flipped else 0, width=width)


def dq_quant(model, codes, consumers, as_table, width):
    """The Quant of a head read through DequantizeLinear (QDQ): its scale, zero point, axis and block."""
    node = next((n for n in consumers.get(codes, []) if n.op_type == "DequantizeLinear" and n.input[0] == codes),
                None)
    if node is None or model.tensors[codes].data_type not in CODES:
        return None
    tokens_axis = 0 if as_table else 1
    block = attribute(node, "block_size", 0)
    return Quant(codes, _input(node, 1), _input(node, 2), 4 if "4" in model.tensors[codes].type_name else 8, False,
                 axis=attribute(node, "axis", 1) % 2, block=block if isinstance(block, int) and block > 0 else None,
                 tokens_axis=tokens_axis, width=width)


def gbq_quant(node, codes, scales, tensor, block, width):
    """The Quant of a GatherBlockQuantized table: the block layout (3-D codes) or ONNX's (2-D, blocked along
    quantize_axis; unsigned codes without a zero point are offset by 2^(bits-1), as the op defaults)."""
    bits = attribute(node, "bits", 4)
    zero = _input(node, 3)
    if len(tensor.dims) == 3:
        return Quant(codes, scales, zero, bits, True, width=width)
    unsigned = tensor.data_type in (TensorProto.UINT4, TensorProto.UINT8)
    return Quant(codes, scales, zero, bits, False, axis=attribute(node, "quantize_axis", 1) % 2, block=block,
                 tokens_axis=attribute(node, "gather_axis", 0) % 2, width=width,
                 default_zero=2 ** (bits - 1) if unsigned else 0)
