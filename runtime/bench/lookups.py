"""a, b: lookups. Gather against numpy's take and OneHot + MatMul, and a lookup at every format: it should cost
the rows it fetches, not the table; b'': the int4 lookup by GatherBlockQuantized against gathering the packed
rows and unpacking them in the graph."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper

import embed
import graphs
from graphs import precision
from graphs.builders import OPSET
from runtime.bench.timing import best_time, bound_run, progress, race, race_rounds, same_round_ratio, session

WIDTH = 768


def bench_lookups(vocabs, tokens, budget):
    """Gather and OneHot+MatMul against numpy take(out=), float32, width 768, `tokens` ids."""
    rows = []
    rng = np.random.default_rng(0)
    for vocab in vocabs:
        table = graphs.make_table(vocab, WIDTH)
        ids = rng.integers(0, vocab, size=(1, tokens), dtype=np.int64)
        out = np.empty((1, tokens, WIDTH), np.float32)
        gather_session = session(graphs.gather_lookup(table))
        times = race({"take": lambda: np.take(table, ids, axis=0, out=out),
                      "gather": bound_run(gather_session, {"ids": ids}, {"embeddings": out})}, budget)
        take, gather = times["take"], times["gather"]
        onehot = best_time(bound_run(session(graphs.onehot_lookup(table)), {"ids": ids}, {"embeddings": out}), budget)
        rows.append({"vocab": vocab, "tokens": tokens, "take_s": take, "gather_s": gather, "onehot_s": onehot,
                     "gather_vs_take": gather / take, "onehot_vs_gather": onehot / gather,
                     "onehot_multiplications": tokens * vocab * WIDTH})
        progress(f"lookup V={vocab} n={tokens}: Gather {gather * 1e6:.0f} us, take {take * 1e6:.0f} us, "
                 f"OneHot+MatMul {onehot * 1e3:.1f} ms")
    return rows


def bench_format_lookups(vocabs, tokens, budget, block_size=32):
    """The lookup graph at every format, at a small and a large vocabulary, raced in the same rounds: the time
    should follow the rows fetched (`tokens`), not the table's size. `large_vs_small` is the median over seven
    rounds of the ratio within a round (both under the same load), `spread` the lowest and highest."""
    rows = []
    rng = np.random.default_rng(1)
    for fmt in embed.FORMATS:
        block = block_size if fmt in ("int8", "int4") else None
        runs = {}
        for vocab in vocabs:
            ids = rng.integers(0, vocab, size=(1, tokens), dtype=np.int64)
            model = graphs.gather_lookup(graphs.make_table(vocab, WIDTH), fmt=fmt, block_size=block)
            out = np.empty((1, tokens, WIDTH), np.float32)
            runs[vocab] = bound_run(session(model), {"ids": ids}, {"embeddings": out})
        rounds = race_rounds(runs, budget, 7)
        times = {v: min(t) for v, t in rounds.items()}
        small, large = min(vocabs), max(vocabs)
        ratio, spread = same_round_ratio(rounds, large, small)
        rows.append({"format": fmt, "block_size": block, "tokens": tokens,
                     "seconds": {str(v): t for v, t in times.items()}, "large_vs_small": ratio, "spread": spread})
        progress(f"{fmt} lookup of {tokens} ids: V={small} {times[small] * 1e6:.0f} us, V={large} "
                 f"{times[large] * 1e6:.0f} us ({times[large] / times[small]:.2f}x)")
    return rows


def packed_rows_lookup(stored):
    """The int4 lookup built the other way, for the bench to race against GatherBlockQuantized: Gather the fetched
    rows' bytes from the uint8 block layout (a graphs.precision.Stored in int4), then unpack only those (low nibble,
    high nibble, interleaved), subtract the zero point and multiply by the rows' gathered scales: the same
    (stored - 8) x scale, one rounding, so the rows equal embed.dequantize's bit for bit."""
    vocab, width = stored.shape
    block = stored.block_size
    codes = precision.pack_blocks(stored.codes, "int4", block)
    const = lambda name, value, dtype: numpy_helper.from_array(np.asarray(value, dtype), name)
    node = helper.make_node
    nodes = [
        node("Gather", ["embedding", "ids"], ["packed"], axis=0),  # [..., blocks, block / 2] bytes of the rows
        node("BitwiseAnd", ["packed", "low_bits"], ["low"]),
        node("BitShift", ["packed", "four"], ["high"], direction="RIGHT"),
        node("Unsqueeze", ["low", "last"], ["low_1"]),
        node("Unsqueeze", ["high", "last"], ["high_1"]),
        node("Concat", ["low_1", "high_1"], ["pairs"], axis=-1),  # the first code of each byte in its low nibble
        node("Cast", ["pairs"], ["stored"], to=TensorProto.FLOAT),
        node("Sub", ["stored", "zero_point"], ["code_pairs"]),
        node("Reshape", ["code_pairs", "blocks_shape"], ["codes"]),
        node("Gather", ["embedding_scale", "ids"], ["row_scales"], axis=0),
        node("Unsqueeze", ["row_scales", "last"], ["row_scales_1"]),
        node("Mul", ["codes", "row_scales_1"], ["values"]),
        node("Reshape", ["values", "rows_shape"], ["embeddings"]),
    ]
    inits = [numpy_helper.from_array(codes, "embedding"), numpy_helper.from_array(stored.scales, "embedding_scale"),
             const("low_bits", 15, np.uint8), const("four", 4, np.uint8), const("last", [-1], np.int64),
             const("zero_point", precision.ZERO_POINT["int4"], np.float32),
             const("blocks_shape", [0, 0, width // block, block], np.int64), const("rows_shape", [0, 0, width], np.int64)]
    graph = helper.make_graph(nodes, "packed_rows_lookup", [helper.make_tensor_value_info("ids", TensorProto.INT64,
                                                                                          ["batch", "seq"])],
                              [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", "seq", width])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def bench_packed_rows(vocab, counts, budget, block_size=32):
    """The int4 lookup two ways, raced in the same rounds at each count of ids: GatherBlockQuantized (the lab's)
    against packed_rows_lookup; the faster is the one to keep."""
    table = precision.store(graphs.make_table(vocab, WIDTH), "int4", block_size)
    models = {"gbq": graphs.gather_lookup(table, fmt="int4", block_size=block_size),
              "packed_rows": packed_rows_lookup(table)}
    sessions = {name: session(model) for name, model in models.items()}
    rows, rng = [], np.random.default_rng(2)
    for tokens in counts:
        ids = rng.integers(0, vocab, size=(1, tokens), dtype=np.int64)
        outs = {name: np.empty((1, tokens, WIDTH), np.float32) for name in sessions}
        times = race({name: bound_run(s, {"ids": ids}, {"embeddings": outs[name]}) for name, s in sessions.items()},
                     budget)
        rows.append({"vocab": vocab, "tokens": tokens, "block_size": block_size, "gbq_s": times["gbq"],
                     "packed_rows_s": times["packed_rows"], "packed_rows_vs_gbq": times["packed_rows"] / times["gbq"],
                     "same_bits": outs["gbq"].tobytes() == outs["packed_rows"].tobytes()})
        progress(f"int4 lookup of {tokens} ids, V={vocab}: GatherBlockQuantized {times['gbq'] * 1e6:.0f} us, "
                 f"packed rows unpacked in the graph {times['packed_rows'] * 1e6:.0f} us")
    return rows
