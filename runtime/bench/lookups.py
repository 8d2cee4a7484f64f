"""a, b: lookups. Gather against numpy's take and OneHot + MatMul, and a lookup at every format: it should cost
the rows it fetches, not the table."""
import numpy as np

import embed
import graphs
from runtime.bench.timing import best_time, bound_run, progress, race, session

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
    should follow the rows fetched (`tokens`), not the table's size."""
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
        times = race(runs, budget)
        small, large = min(vocabs), max(vocabs)
        rows.append({"format": fmt, "block_size": block, "tokens": tokens,
                     "seconds": {str(v): t for v, t in times.items()}, "large_vs_small": times[large] / times[small]})
        progress(f"{fmt} lookup of {tokens} ids: V={small} {times[small] * 1e6:.0f} us, V={large} "
                 f"{times[large] * 1e6:.0f} us ({times[large] / times[small]:.2f}x)")
    return rows
