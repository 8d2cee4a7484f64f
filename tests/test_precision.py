"""Precision: embed.quantize / dequantize / table_bytes against hand-worked values and numpy's own conversions,
graphs.precision against embed bit for bit, and every builder at every format in onnxruntime."""
import math
import struct

import numpy as np
import onnx
import pytest

import embed
import graphs
from graphs import precision
from runtime.runner import Runner

FLOATS = ("float32", "float16", "bfloat16")


def bits(values):
    return np.asarray(values, dtype=np.float32).view(np.uint32)



def gamma(n):
    """Higham's gamma_n for float32."""
    return n * 2.0**-24 / (1 - n * 2.0**-24)


def test_formats_in_order():
    assert embed.FORMATS == ("float32", "float16", "bfloat16", "int8", "int4")


def test_float16_rounds_to_nearest_even_like_numpy():
    table = embed.make_table(64, 16, seed=5)
    codes, scales = embed.quantize(table, "float16")
    assert scales is None
    assert np.array_equal(bits(codes), np.asarray(table, np.float32).astype(np.float16).astype(np.float32).view(np.uint32))
    # 1 + 2**-11 lies halfway between float16 neighbours 1 and 1 + 2**-10: ties go to the even one, 1
    assert embed.quantize([[1 + 2**-11, 1 + 3 * 2**-11]], "float16")[0] == [[1.0, 1 + 2**-9]]
    with pytest.raises(ValueError):
        embed.quantize([[65520.0]], "float16")  # rounds past float16's largest finite value


def test_bfloat16_keeps_the_top_16_bits_rounded_to_even():
    # 1 + 2**-8 is halfway between bfloat16 neighbours 1 and 1 + 2**-7: to even, 1; just above it rounds up
    above = struct.unpack("<f", struct.pack("<I", 0x3F808001))[0]
    assert embed.quantize([[1 + 2**-8, 1 + 3 * 2**-8, above, -(1 + 3 * 2**-8)]], "bfloat16")[0] == [
        [1.0, 1 + 2**-6, 1 + 2**-7, -(1 + 2**-6)]]
    with pytest.raises(ValueError):
        embed.quantize([[3.4e38]], "bfloat16")  # rounds up past bfloat16's largest finite value


def test_int8_blocks_worked_by_hand():
    codes, scales = embed.quantize([[0.5, -1.0, 0.25, 0.0, 0.0, 0.0]], "int8", block_size=4)
    s = struct.unpack("<f", struct.pack("<f", 1.0 / 127))[0]
    assert scales == [[s, 1.0]]  # the second block is all zero: scale 1.0
    assert codes == [[round(0.5 / s), -127, round(0.25 / s), 0, 0, 0]]
    assert codes[0][0] == 64 and codes[0][2] == 32  # 63.5 -> 64 (half to even), 31.75 -> 32
    rows = embed.dequantize(codes, scales, "int8", block_size=4)
    assert rows[0][:3] == [np.float32(64 * np.float32(s)), -1.0, np.float32(32 * np.float32(s))]


def test_int4_clamps_and_the_last_block_is_shorter():
    codes, scales = embed.quantize([[7.0, 3.5, -7.0, 1.0, 2.0]], "int4", block_size=3)
    assert scales == [[1.0, struct.unpack("<f", struct.pack("<f", 2.0 / 7))[0]]]
    assert codes[0][:3] == [7, 4, -7]  # 3.5 -> 4: half to even
    assert max(map(abs, codes[0])) <= 7


def test_table_bytes():
    assert embed.table_bytes(128256, 4096) == 128256 * 4096 * 4  # Llama 3's table: 1.96 GiB
    assert embed.table_bytes(128256, 4096, "bfloat16") == 128256 * 4096 * 2
    assert embed.table_bytes(128256, 4096, "int4", block_size=32) == 128256 * 4096 // 2 + 4 * 128256 * 128
    assert embed.table_bytes(3, 3, "int4") == 5 + 4 * 3  # ceil(9 / 2) bytes of codes, a scale a row
    assert embed.table_bytes(10, 6, "int8", block_size=4, tied=False) == 2 * (60 + 4 * 10 * 2)
    with pytest.raises(ValueError):
        embed.table_bytes(10, 6, "int2")
    with pytest.raises(TypeError):
        embed.table_bytes(10, 6, "int8", block_size=2.0)
    with pytest.raises(ValueError):
        embed.quantize([[math.nan]], "int8")
    with pytest.raises(ValueError):
        embed.quantize([], "float16")


CASES = [(fmt, None) for fmt in FLOATS] + [("int8", None), ("int8", 5), ("int8", 16), ("int4", None), ("int4", 16),
                                          ("int4", 32)]


@pytest.mark.parametrize("fmt, block_size", CASES)
def test_numpy_quantize_matches_the_reference(fmt, block_size):
    table = embed.make_table(97, 40, seed=11)
    codes, scales = embed.quantize(table, fmt, block_size)
    reference = embed.dequantize(codes, scales, fmt, block_size)
    ncodes, nscales = precision.quantize(graphs.make_table(97, 40, seed=11), fmt, block_size)
    if fmt in ("int8", "int4"):
        assert ncodes.tolist() == codes and bits(nscales).tolist() == bits(scales).tolist()
    assert np.array_equal(precision.dequantize(ncodes, nscales, fmt, block_size).view(np.uint32), bits(reference))


@pytest.mark.parametrize("fmt, block_size", [c for c in CASES if c != ("int8", 5)])
def test_builders_at_every_format(fmt, block_size):
    """Lookups equal embed.dequantize rows bit for bit (OneHot + MatMul too); initializers hold table_bytes; the
    tied head reads the same initializers as the lookup and stays within float32's bound of the decoded table."""
    vocab, width = 131, 48
    table = graphs.make_table(vocab, width, seed=2)
    codes, scales = embed.quantize(embed.make_table(vocab, width, seed=2), fmt, block_size)
    rows = np.asarray(embed.dequantize(codes, scales, fmt, block_size), np.float32)
    ids = np.array([[0, 130, 7, 7]])
    hidden = np.random.default_rng(0).standard_normal((1, 4, width)).astype(np.float32)
    for build in (graphs.gather_lookup, graphs.onehot_lookup, graphs.scaled_lookup, graphs.tied_logits):
        model = build(table, fmt=fmt, block_size=block_size)
        stored = {t.name: len(t.raw_data) for t in model.graph.initializer if t.name.startswith("embedding")}
        assert sum(stored.values()) == embed.table_bytes(vocab, width, fmt, block_size), build.__name__
        feeds = {"ids": ids} | ({"hidden": hidden} if build is graphs.tied_logits else {})
        out = Runner(model).run(feeds)
        expect = rows[ids] * np.float32(math.sqrt(width)) if build is graphs.scaled_lookup else rows[ids]
        assert np.array_equal(out["embeddings"].view(np.uint32), expect.view(np.uint32)), build.__name__
        if build is graphs.tied_logits:
            readers = [n.name for n in model.graph.node if "embedding" in n.input]
            # two readers of the one table at every format: the lookup, and the head (its decode; float32: the tie's
            # view; the block layout: MatMulNBits on the codes themselves)
            assert len(readers) == 2 and "lookup" in readers, readers
            quantized_head = any(n.op_type == "MatMulNBits" for n in model.graph.node)
            assert quantized_head == (fmt in ("int8", "int4") and block_size == 16)  # 16 | 48; None spans the row
            exact = hidden.astype(np.float64) @ rows.T.astype(np.float64)
            products = np.abs(hidden).astype(np.float64) @ np.abs(rows).T.astype(np.float64)
            bound = gamma(width + 2 if quantized_head else width) * products
            if quantized_head:  # accuracy_level 4: hidden rounded to int8 per block, at most half its step away
                step = np.abs(hidden).reshape(4, width // 16, 16).max(-1) / 127 * (1 + 2**-22)
                moved = np.repeat(step / 2, 16, axis=-1).reshape(1, 4, width) + 2**-23 * np.abs(hidden)
                level4 = moved.astype(np.float64) @ np.abs(rows).T.astype(np.float64) + gamma(width // 16 + 2) * (
                    (np.abs(hidden) + moved).astype(np.float64) @ np.abs(rows).T.astype(np.float64)) + 2**-24 * products
                assert np.all(np.abs(out["logits"] - exact) <= level4 * (1 + 1e-12))
                assert np.any(np.abs(out["logits"] - exact) > bound)  # it does quantize: float32's bound is broken
                model = build(table, fmt=fmt, block_size=block_size, accuracy_level=0)
                out = Runner(model).run(feeds)
            assert np.all(np.abs(out["logits"] - exact) <= bound)
    untied = graphs.untied_logits(table, table[::-1].copy(), fmt=fmt, block_size=block_size)
    held = sum(len(t.raw_data) for t in untied.graph.initializer if t.name.startswith(("embedding", "lm_head")))
    assert held == embed.table_bytes(vocab, width, fmt, block_size, tied=False)


def test_no_lookup_decodes_the_whole_table():
    for fmt, block_size in CASES[1:]:
        if (fmt, block_size) == ("int8", 5):
            continue
        model = graphs.gather_lookup(graphs.make_table(64, 32), fmt=fmt, block_size=block_size)
        (reader,) = [n for n in model.graph.node if "embedding" in n.input]
        assert reader.op_type in ("Gather", "GatherBlockQuantized"), (fmt, reader.op_type)


def test_int4_lookup_block_rule():
    with pytest.raises(ValueError, match="power of two"):
        graphs.gather_lookup(graphs.make_table(8, 40), fmt="int4", block_size=20)
    model = graphs.gather_lookup(graphs.make_table(8, 40), fmt="int4")
    assert {o.domain for o in model.opset_import} == {"", "com.microsoft"}
    assert [t.data_type for t in model.graph.initializer][:2] == [onnx.TensorProto.INT4, onnx.TensorProto.FLOAT]


@pytest.mark.parametrize("fmt, block_size", [("float32", None), ("float16", None), ("int8", 16), ("int4", 16)])
def test_a_stored_table_builds_the_same_graph_and_stretches_row_by_row(fmt, block_size):
    table = graphs.make_table(64, 32, seed=4)
    stored = precision.store(table, fmt, block_size)
    initializers = lambda model: {t.name: t.raw_data for t in model.graph.initializer}
    for build in (graphs.gather_lookup, graphs.tied_logits, lambda t, **kw: graphs.neighbors(t, "cosine", **kw)):
        assert initializers(build(stored, fmt=fmt, block_size=block_size)) == \
            initializers(build(table, fmt=fmt, block_size=block_size))
    changed = table.copy()
    changed[5] *= np.float32(4.0)
    again = precision.store(changed, fmt, block_size)
    row = stored.with_row(5, changed[5])
    assert np.array_equal(row.codes, again.codes) and (row.scales is None or np.array_equal(row.scales, again.scales))
    assert np.array_equal(stored.codes, precision.quantize(table, fmt, block_size)[0])  # the original stays
    with pytest.raises(ValueError, match="stored as"):
        graphs.gather_lookup(stored, fmt="bfloat16")
