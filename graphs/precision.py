"""The table stored in a format of embed.FORMATS, and the nodes that read it back as float32.

numpy does what embed.quantize does, bit for bit (the tests compare them value by value); the graphs then hold
the codes once, in their own ONNX type, and decode only what an op needs:

- a lookup decodes the rows it fetches: Gather then Cast (float16, bfloat16), Gather of codes and of scales then
  DequantizeLinear (int8), or onnxruntime's GatherBlockQuantized (int4: ONNX's Gather does not take INT4, and
  gathering packed bytes would need a dozen bit-twiddling nodes for what this one contrib op does);
- a head or a one-hot product needs every row, so it reads the whole table through Cast / DequantizeLinear.

int8 and int4 with a block onnxruntime's quantized kernels take (a power of two >= 16 that divides the width) are
stored instead in their uint8 block layout, [vocab, blocks, block * bits / 8], codes offset by the kernels'
default zero point (128 / 8): GatherBlockQuantized looks rows up in it and MatMulNBits scores every row from it,
reading the same bytes, so the head reads the codes at the speed of their bytes rather than decoding the table
on every run (blocks(): which graphs and shapes).
"""
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from onnx import TensorProto, helper

import embed
from graphs.tie import unfolded_view

ONNX_TYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
             "int8": TensorProto.INT8, "int4": TensorProto.INT4}
QMAX = embed.QMAX  # the symmetric code range of each integer format, the reference's


ZERO_POINT = {"int8": 128, "int4": 8}  # the default of MatMulNBits and GatherBlockQuantized: stored = code + it
ACCURACY_LEVELS = (0, 4)  # MatMulNBits: 0 float32 products of the decoded codes, 4 the hidden vector as int8 too


def blocks(fmt, block_size, width):
    """Whether `fmt` at `block_size` is stored in the uint8 block layout onnxruntime's quantized kernels read: int8 /
    int4 with a block that is a power of two >= 16 and divides the width (else ONNX INT8 / INT4, as before)."""
    return (fmt in ZERO_POINT and isinstance(block_size, int) and block_size >= 16
            and not block_size & (block_size - 1) and width % block_size == 0)


def pack_blocks(codes, fmt, block_size):
    """int8 codes [vocab, width] as the block layout: uint8 [vocab, blocks, block * bits / 8] holding code + zero
    point, int4 two a byte (the first in the low nibble). Adding in uint8 wraps exactly as the offset needs."""
    vocab, width = codes.shape
    stored = (codes.view(np.uint8) + np.uint8(ZERO_POINT[fmt])).reshape(vocab, width // block_size, block_size)
    if fmt == "int4":
        stored = stored[..., 0::2] | (stored[..., 1::2] << np.uint8(4))
    return np.ascontiguousarray(stored)


def format_name(data_type):
    """One of embed.FORMATS for an ONNX tensor type (uint8 codes are named by their reader: see runtime.inspect),
    or the ONNX type's own name, lower case."""
    names = {v: k for k, v in ONNX_TYPE.items()}
    return names.get(data_type) or TensorProto.DataType.Name(data_type).lower()
_CHUNK = 8 * 2**20  # bytes of float64 work at a time: quantizing stays in cache-sized pieces


def check_format(fmt, block_size):
    """The reference's checks on a format and block size (ValueError / TypeError)."""
    embed.table_bytes(1, 1, fmt, block_size)


def quantize(table, fmt, block_size=None):
    """(codes, scales) as numpy arrays equal to embed.quantize(table, fmt, block_size) value for value.

    codes: float32 / float16 arrays, bfloat16 as its uint16 bit patterns, int8 codes (int4 codes too, unpacked);
    scales: float32 [vocab, blocks] for int8 / int4, else None."""
    check_format(fmt, block_size)
    table = np.asarray(table, dtype=np.float32)
    if not np.isfinite(table).all():
        raise ValueError("the table holds NaN or inf")
    if fmt == "float32":
        return table, None
    if fmt == "float16":
        with np.errstate(over="ignore"):
            codes = table.astype(np.float16)
        if not np.isfinite(codes).all():
            raise ValueError("a value is beyond float16's finite range (65504)")
        return codes, None
    if fmt == "bfloat16":
        bits = table.view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
        if ((rounded & np.uint16(0x7F80)) == np.uint16(0x7F80)).any():
            raise ValueError("a value is beyond bfloat16's finite range")
        return rounded, None
    vocab, width = table.shape
    size = width if block_size is None else block_size
    blocks = -(-width // size)
    qmax = QMAX[fmt]
    codes = np.empty((vocab, width), np.int8)
    scales = np.empty((vocab, blocks), np.float32)
    step = max(1, _CHUNK // (8 * blocks * size))
    padded = np.zeros((min(step, vocab), blocks * size), np.float64)  # float64: x / scale as Python divides
    for start in range(0, vocab, step):
        rows = table[start:start + step]
        work = padded[:len(rows)]
        work[:, :width] = rows
        shaped = work.reshape(len(rows), blocks, size)
        block_scales = (np.abs(shaped).max(axis=2) / qmax).astype(np.float32)
        block_scales[block_scales == 0] = 1.0
        scales[start:start + step] = block_scales
        shaped /= block_scales[:, :, None]
        np.rint(work, out=work)
        np.clip(work, -qmax, qmax, out=work)
        codes[start:start + step] = work[:, :width]
    return codes, scales


def dequantize(codes, scales, fmt, block_size=None):
    """float32 [vocab, width] from quantize's output: embed.dequantize bit for bit."""
    if fmt == "bfloat16":
        return (codes.astype(np.uint32) << 16).view(np.float32)
    if scales is None:
        return codes.astype(np.float32)
    width = codes.shape[1]
    size = width if block_size is None else block_size
    return (codes * np.repeat(scales, size, axis=1)[:, :width]).astype(np.float32)  # exact product, one rounding


@dataclass(frozen=True)
class Stored:
    """A table quantized once, by store(): every builder takes one in place of the float32 table (with the same
    fmt and block_size), so graphs that share a table in one format share one quantization."""
    codes: np.ndarray
    scales: np.ndarray | None
    fmt: str
    block_size: int | None

    @property
    def shape(self):
        return self.codes.shape

    def with_row(self, row, values):
        """This table with row `row` replaced by the float32 `values`, that row quantized alone (quantizing goes
        row by row, so the result equals storing the whole changed table)."""
        codes, scales = quantize(np.asarray(values, np.float32)[None, :], self.fmt, self.block_size)
        new = Stored(self.codes.copy(), None if scales is None else self.scales.copy(), self.fmt, self.block_size)
        new.codes[row] = codes[0]
        if scales is not None:
            new.scales[row] = scales[0]
        return new


def store(table, fmt, block_size=None):
    """The float32 [vocab, width] `table` quantized once into a Stored, for builders to share."""
    return Stored(*quantize(table, fmt, block_size), fmt, block_size)


def pack_int4(codes):
    """int4 codes as ONNX stores INT4: two a byte, the first in the low nibble, flat over the tensor."""
    flat = codes.reshape(-1).astype(np.uint8) & np.uint8(15)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return flat[0::2] | (flat[1::2] << np.uint8(4))


def initializers(table, fmt, block_size, name="embedding", in_blocks=False):
    """[(name, data, dims, onnx type, doc)] of the table (an array, or a Stored in `fmt`) stored in `fmt`: codes,
    and float32 scales for int8/int4; `in_blocks` (where blocks() allows it): the uint8 block layout."""
    if fmt == "float32":  # the values themselves: nothing to quantize, and a 2 GiB table is not copied
        values = table.codes if isinstance(table, Stored) else table
        return [(name, values, list(values.shape), TensorProto.FLOAT,
                 "float32 values [vocab, width]: row t is token t's vector")]
    stored = table if isinstance(table, Stored) else store(table, fmt, block_size)
    codes, scales = stored.codes, stored.scales
    if in_blocks:
        data = pack_blocks(codes, fmt, block_size)
        return [(name, data, list(data.shape), TensorProto.UINT8,
                 f"{fmt} codes + {ZERO_POINT[fmt]} in onnxruntime's block layout [vocab, blocks, block * "
                 f"{4 if fmt == 'int4' else 8} / 8 bytes]"),
                (name + "_scale", scales, list(scales.shape), TensorProto.FLOAT,
                 f"float32 scales [vocab, blocks], one per {block_size} columns: value = code x scale")]
    data = pack_int4(codes) if fmt == "int4" else codes
    blocks = f"one per {block_size} columns" if block_size else "one per row"
    out = [(name, data, list(stored.shape), ONNX_TYPE[fmt], f"{fmt} codes [vocab, width]")]
    if scales is not None:
        out.append((name + "_scale", scales, list(scales.shape), TensorProto.FLOAT,
                    f"float32 scales [vocab, blocks], {blocks}: value = code x scale"))
    return out


def _gbq_block(width, block_size):
    """GatherBlockQuantized's block: a power of two >= 16; None (one scale a row) spans the row."""
    if block_size is None:
        return max(16, 1 << (width - 1).bit_length())
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"int4 lookups need block_size a power of two >= 16 (onnxruntime's GatherBlockQuantized), "
                         f"got {block_size}")
    return block_size


def check_graph_format(fmt, block_size, width):
    """check_format, plus what the int4 lookup op requires."""
    check_format(fmt, block_size)
    if fmt == "int4":
        _gbq_block(width, block_size)


class Layout(NamedTuple):
    """A vocab x width table as a graph holds it, for the nodes that read it: the initializer `name` (its scales
    `name`_scale), stored in `fmt` at `block_size`; `in_blocks`: in the uint8 block layout (where blocks() allows)."""
    fmt: str
    block_size: int | None
    vocab: int
    width: int
    name: str = "embedding"
    in_blocks: bool = False


def lookup_nodes(layout, output, ids="ids", ids_rank=2):
    """(nodes, constants {name: array}, value_info) reading float32 rows `output` = decoded table[ids], decoding
    only those rows; from the uint8 block layout where `layout.in_blocks` (`ids_rank`: the rank of `ids`)."""
    fmt, block_size, width, table = layout.fmt, layout.block_size, layout.width, layout.name
    doc = ("embedding[ids]: copies one row per id, no multiplications; a negative id wraps, one >= vocab is an error "
           "(the runner refuses both first)")
    if layout.in_blocks:
        return _block_lookup(layout, output, ids, ids_rank, doc)
    if fmt == "float32":
        return [helper.make_node("Gather", [table, ids], [output], name="lookup", doc_string=doc, axis=0)], {}, []
    if fmt == "int4":
        return [helper.make_node(
            "GatherBlockQuantized", [table, ids, table + "_scale"], [output], name="lookup", domain="com.microsoft",
            doc_string=doc + "; decodes the fetched int4 rows only: code x scale", gather_axis=0, quantize_axis=1,
            block_size=_gbq_block(width, block_size))], {}, []
    codes = output + "_codes"
    nodes = [helper.make_node("Gather", [table, ids], [codes], name="lookup", doc_string=doc + f" ({fmt} codes)",
                              axis=0)]
    if fmt == "int8":
        nodes += [helper.make_node("Gather", [table + "_scale", ids], [output + "_scales"], name="lookup_scales",
                                   doc_string="the fetched rows' scales", axis=0),
                  helper.make_node("DequantizeLinear", [codes, output + "_scales"], [output], name="decode_rows",
                                   doc_string="code x scale, for the fetched rows only", axis=-1,
                                   block_size=block_size or width)]
    else:
        nodes.append(helper.make_node("Cast", [codes], [output], name="decode_rows",
                                      doc_string=f"{fmt} -> float32, exact, for the fetched rows only",
                                      to=TensorProto.FLOAT))
    return nodes, {}, []


def table_nodes(layout, output):
    """(nodes, input name) giving the whole table as float32 (a head or a one-hot product reads every row)."""
    fmt, block_size, width, table = layout.fmt, layout.block_size, layout.width, layout.name
    if fmt == "float32":
        return [], table
    if fmt in ("int8", "int4"):
        return [helper.make_node("DequantizeLinear", [table, table + "_scale"], [output], name="decode_table",
                                 doc_string="code x scale for every row (a head reads them all)", axis=1,
                                 block_size=block_size or width)], output
    return [helper.make_node("Cast", [table], [output], name="decode_table",
                             doc_string=f"{fmt} -> float32 for every row (a head reads them all)",
                             to=TensorProto.FLOAT)], output


def _block_lookup(layout, output, ids, ids_rank, doc):
    """GatherBlockQuantized on the block layout: its 3-D codes want [vocab, blocks, 1] scales, which it reads through
    a run-time view of the [vocab, blocks] ones MatMulNBits reads (a folded Unsqueeze would be a second copy), and
    its rows come out [..., blocks, block], which one Reshape of the fetched rows makes [..., width]."""
    fmt, block_size, vocab, width, table = layout.fmt, layout.block_size, layout.vocab, layout.width, layout.name
    scale_view, constants, value_info = unfolded_view(table + "_scale", ids, [vocab, width // block_size, 1],
                                                      "lookup_scales", "lookup_scales_", TensorProto.INT64)
    shape = "lookup_rows_shape"
    constants[shape] = np.asarray([0] * ids_rank + [width], np.int64)
    nodes = scale_view + [
        helper.make_node("GatherBlockQuantized", [table, ids, "lookup_scales"], [output + "_blocks"],
                         name="lookup", domain="com.microsoft", gather_axis=0, quantize_axis=2, block_size=block_size,
                         bits=4 if fmt == "int4" else 8,
                         doc_string=doc + f"; decodes the fetched {fmt} rows only: (stored - {ZERO_POINT[fmt]}) x scale"),
        helper.make_node("Reshape", [output + "_blocks", shape], [output], name="rows_of_blocks",
                         doc_string="the fetched rows [..., blocks, block] -> [..., width]"),
    ]
    value_info.append(helper.make_tensor_value_info("lookup_scales", TensorProto.FLOAT,
                                                    [vocab, width // block_size, 1]))
    return nodes, constants, value_info


def head_node(layout, hidden, output, accuracy_level, name, doc):
    """MatMulNBits scoring `hidden` [..., width] against every row of the block layout: [..., vocab] logits."""
    table = layout.name
    return helper.make_node("MatMulNBits", [hidden, table, table + "_scale"], [output], name=name, domain="com.microsoft",
                            K=layout.width, N=layout.vocab, bits=4 if layout.fmt == "int4" else 8,
                            block_size=layout.block_size, accuracy_level=accuracy_level, doc_string=doc)
