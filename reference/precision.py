"""Precision: the table stored as float16, bfloat16, int8 or int4 codes, read back, and what it costs in bytes."""
import math
import struct

from reference.tables import check_int, shape

# Precision: what the vocabulary costs in bytes. Formats in this order everywhere.
FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")
_VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
QMAX = {"int8": 127, "int4": 7}  # symmetric codes in [-qmax, qmax]
_F32 = struct.Struct("<f")


def _float32(x):
    """`x` rounded to the nearest float32 (ties to even), as a Python float."""
    return _F32.unpack(_F32.pack(x))[0]


def _rounded(values, code="f"):
    """`values` rounded to the nearest float32 ('f') or float16 ('e'), ties to even, as Python floats: one struct
    call for the whole row (OverflowError for a finite value past the format's range)."""
    layout = f"<{len(values)}{code}"
    return list(struct.unpack(layout, struct.pack(layout, *values)))


def _check_format(fmt, block_size):
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; want one of {', '.join(FORMATS)}")
    if block_size is not None:
        check_int("block_size", block_size, 1)


def _blocks(width, block_size):
    """[(start, stop)] of each block of a row: `block_size` columns (None: the whole row), the last maybe shorter."""
    size = width if block_size is None else block_size
    return [(start, min(start + size, width)) for start in range(0, width, size)]


def _to_float16(row):
    try:
        return _rounded(row, "e")  # IEEE binary16, nearest, ties to even
    except OverflowError:
        raise ValueError("a value is beyond float16's finite range (65504)") from None


def _to_bfloat16(row):
    layout = f"<{len(row)}I"
    bits = [(b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16  # the top 16 bits of the float32, nearest, ties to even
            for b in struct.unpack(layout, struct.pack(f"<{len(row)}f", *row))]
    if any(b & 0x7F800000 == 0x7F800000 for b in bits):
        raise ValueError("a value is beyond bfloat16's finite range")
    return list(struct.unpack(f"<{len(row)}f", struct.pack(layout, *bits)))


def quantize(table, fmt, block_size=None):
    """(codes, scales) of `table` stored in `fmt`, after rounding every value to float32.

    float16 / bfloat16: codes are the values rounded to the format (nearest, ties to even), scales None.
    int8 / int4: symmetric, one float32 scale per block of `block_size` columns of a row (None: the row),
    scale = float32(max|x| / qmax) (1.0 for an all-zero block), code = round-half-even(x / scale) clamped to
    [-qmax, qmax], qmax 127 / 7; codes are ints and scales a list of rows.
    """
    _check_format(fmt, block_size)
    shape(table)
    try:
        rows = [_rounded(row) for row in table]
    except OverflowError:
        raise ValueError("the table holds a value beyond float32's range") from None
    if not all(all(map(math.isfinite, row)) for row in rows):
        raise ValueError("the table holds NaN or inf")
    if fmt in ("float32", "float16", "bfloat16"):
        to = {"float32": list, "float16": _to_float16, "bfloat16": _to_bfloat16}[fmt]
        return [to(row) for row in rows], None
    qmax, blocks = QMAX[fmt], _blocks(len(rows[0]), block_size)
    codes, scales = [], []
    for row in rows:
        row_scales = [_float32(max(map(abs, row[a:b])) / qmax) or 1.0 for a, b in blocks]
        row_codes = [round(x / scale) for (a, b), scale in zip(blocks, row_scales) for x in row[a:b]]
        if max(map(abs, row_codes)) > qmax:  # a scale rounded down can put x / scale a hair past qmax
            row_codes = [max(-qmax, min(qmax, code)) for code in row_codes]
        codes.append(row_codes)
        scales.append(row_scales)
    return codes, scales


def dequantize(codes, scales, fmt, block_size=None):
    """The table `quantize` stored: float formats, the codes; int8 / int4, float32(code x scale), rounded once
    (the product of a small int and a float32 is exact in a Python float)."""
    _check_format(fmt, block_size)
    shape(codes)
    if fmt in ("float32", "float16", "bfloat16"):
        return [[float(x) for x in row] for row in codes]
    blocks = _blocks(len(codes[0]), block_size)
    if scales is None or len(scales) != len(codes) or any(len(row) != len(blocks) for row in scales):
        raise ValueError(f"want {len(codes)} rows of {len(blocks)} scales for {fmt} blocks of {block_size}")
    return [_rounded([code * scale for (a, b), scale in zip(blocks, row_scales) for code in row[a:b]])
            for row, row_scales in zip(codes, scales)]


def table_bytes(vocab_size, width, fmt="float32", block_size=None, tied=True):
    """Bytes the table takes as stored in `fmt` (codes plus float32 scales; int4 packs two codes a byte), and
    as much again for an untied head."""
    check_int("vocab_size", vocab_size, 1)
    check_int("width", width, 1)
    _check_format(fmt, block_size)
    if fmt == "int4":
        stored = (vocab_size * width + 1) // 2
    else:
        stored = vocab_size * width * _VALUE_BYTES[fmt]
    if fmt in QMAX:
        stored += 4 * vocab_size * len(_blocks(width, block_size))
    return stored * (1 if tied else 2)
