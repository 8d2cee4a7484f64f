"""d': the memory meeting. The tied head at every format: the bytes it stores, what a session holds after a
one-token run under onnxruntime's default SessionOptions (a fresh process each, so no activations to speak of), its time per token and per 64-token prompt
(every format raced in the same rounds, their thread pools not spinning after a run: a spinning pool slows
whichever session runs next, 7 ms a token against 25 ms measured at 50257 x 768) against numpy's float32 matmul and against the floor its bytes set
(table_bytes over this machine's memory bandwidth, measured in the same run), and what it costs in accuracy
against the float32 head.

One variant beside the formats: bfloat16 with onnxruntime's constant folding off. This CPU provider has no
half-precision MatMul, so the head's Cast of the codes to float32 is folded at load into a float32 copy held beside
the codes the lookup reads; with folding off the codes are held once and the Cast decodes the whole table on every
run: bytes traded for time."""
import os
import threading
import time

import numpy as np

import embed
import graphs
from runtime.bench.probes import child
from runtime.bench.timing import progress, race_rounds, same_round_ratio
from runtime.runner import Runner

BLOCK = 32  # int8 / int4 columns per scale: the block layout MatMulNBits reads
PROMPT = 64
UNFOLDED = ("bfloat16", "constant folding off", ("ConstantFolding",))  # (format, variant, skipped)


def bandwidth(seconds=1.0, size=1 << 30):
    """Bytes per second of a streaming read larger than the caches: one pass over `size` bytes with two threads
    (numpy's reduction releases the GIL), the best over `seconds`."""
    data = np.ones(size // 8, np.uint64)
    halves = np.array_split(data, 2)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end or best == 0.0:
        threads = [threading.Thread(target=np.bitwise_or.reduce, args=(h,)) for h in halves]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = max(best, data.nbytes / (time.perf_counter() - start))
    return best


def _accuracy(logits, reference, k=8):
    """(mean top-k overlap, largest |logit error|) of a head's logits against the float32 ones, per hidden vector."""
    top = lambda x: [set(np.argpartition(-row, k)[:k].tolist()) for row in x]
    overlap = float(np.mean([len(a & b) / k for a, b in zip(top(logits), top(reference))]))
    return overlap, float(np.max(np.abs(logits.astype(np.float64) - reference)))


def _contenders():
    """[(key, format, variant, disabled optimizers)]: every format as users load it, then the unfolded variant."""
    fmt, variant, disabled = UNFOLDED
    return [(f, f, None, ()) for f in embed.FORMATS] + [(f"{fmt}, {variant}", fmt, variant, disabled)]


def bench_formats(sizes, budget, folder):
    """One row per size and contender (each format, then the bfloat16 variant); `folder` holds each model while it
    is measured."""
    rows = []
    floor_rate = bandwidth()
    progress(f"memory bandwidth: {floor_rate / 1e9:.1f} GB/s (a streaming read of 1 GiB, two threads)")
    for vocab, width in sizes:
        table = graphs.make_table(vocab, width)
        numpy_s = child("numpy_matmul", vocab, width, [1, PROMPT], budget, 3)["seconds"]
        hidden = np.random.default_rng(5).standard_normal((1, PROMPT, width)).astype(np.float32)
        reference = hidden[0] @ table.T
        runners, found = {}, {}
        for key, fmt, variant, disabled in _contenders():
            block = BLOCK if fmt in ("int8", "int4") else None
            path = os.path.join(folder, f"tied_{fmt}_{vocab}x{width}.onnx")
            if variant is None:  # a variant reads its format's file
                graphs.save(graphs.tied_logits(table, fmt=fmt, block_size=block), path, external=True,
                            overwrite=True, check=False)
            held = child("session_growth", path, width, 1, disabled)  # a one-token run, defaults, a fresh process
            runners[key] = Runner(path, spinning=False, disabled_optimizers=disabled)
            logits = runners[key].run({"ids": np.zeros((1, PROMPT), np.int64), "hidden": hidden})["logits"][0]
            found[key] = {"format": fmt, "variant": variant, "path": path, "block_size": block, "held": held,
                          "table_bytes": embed.table_bytes(vocab, width, fmt, block),
                          "accuracy": _accuracy(logits, reference)}
            progress(f"{key} {vocab} x {width}: {held['resident_bytes'] / found[key]['table_bytes']:.2f}x "
                     "table_bytes resident after a run under the defaults")
        for n in (1, PROMPT):
            step = {"ids": np.zeros((1, n), np.int64), "hidden": hidden[:, :n]}
            outputs = {k: {"logits": np.empty((1, n, vocab), np.float32),
                           "embeddings": np.empty((1, n, width), np.float32)} for k in runners}
            rounds = race_rounds({k: (lambda k=k: runners[k].run(step, out=outputs[k])) for k in runners}, budget, 5)
            for key, seconds in rounds.items():
                found[key][f"n{n}_s"] = min(seconds)
                found[key][f"n{n}_vs_float32"] = same_round_ratio(rounds, key, "float32")
        runners = None  # the sessions go before the next size (rebound, not del: the lambdas read it)
        for key, r in found.items():
            floor = r["table_bytes"] / floor_rate
            rows.append({"vocab": vocab, "width": width, "format": r["format"], "variant": r["variant"],
                         "block_size": r["block_size"], "table_bytes": r["table_bytes"], **r["held"],
                         "times_table": r["held"]["resident_bytes"] / r["table_bytes"],
                         "token_s": r["n1_s"], "prompt_s": r[f"n{PROMPT}_s"],
                         "token_vs_float32": r["n1_vs_float32"][0], "token_spread": r["n1_vs_float32"][1],
                         "prompt_vs_float32": r[f"n{PROMPT}_vs_float32"][0],
                         "token_vs_numpy": r["n1_s"] / numpy_s["1"], "floor_s": floor, "token_vs_floor": r["n1_s"] / floor,
                         "top8_overlap": r["accuracy"][0], "logit_error": r["accuracy"][1],
                         "bandwidth": floor_rate})
            progress(f"{key} {vocab} x {width}: {r['n1_s'] * 1e3:.2f} ms a token ({r['n1_s'] / floor:.1f}x its byte "
                     f"floor), {r[f'n{PROMPT}_s'] * 1e3:.1f} ms a {PROMPT}-token prompt")
        for r in found.values():
            if r["variant"] is None:
                os.remove(r["path"])
                os.remove(graphs.storage.data_path(r["path"]))
        del table
    return rows
