"""c: the tied head through Runner.run, the path every tool here uses, against numpy at its strongest.

numpy runs in a child process with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (a machine may pin a slower
kernel through them), twice, before and after onnxruntime is timed, and its best is kept; the kernel OpenBLAS
picked is read from the library numpy loaded. Where neither is set here, numpy's matmul(out=) also races in the
same rounds as Runner.run, and the ratios judged are the median of those same-round ratios (spread kept). Memory is measured in a fresh process after N = max runs of the
default path, with the logits it returned still held.
"""
import os

import numpy as np
from onnx import TensorProto, helper

import graphs
from graphs.table import make_table
from runtime.bench.probes import UNSET, child
from runtime.bench.timing import bound_run, progress, race, race_rounds, same_round_ratio, session
from runtime.runner import Runner

SETTLE = 0.2  # seconds between contenders when numpy races here: its OpenBLAS threads spin ~0.1 s after a call


def bench_head(sizes, counts, budget, folder):
    """Per size and N: numpy's best 2-D matmul, Runner.run(feeds) and Runner.run(feeds, out=...), and resident
    memory after runs against the table plus the logits returned."""
    rows = []
    for vocab, width in sizes:
        rounds = 3 if vocab * width > 10**8 else 5
        path = os.path.join(folder, f"tied_{vocab}x{width}.onnx")
        graphs.save(graphs.tied_logits(graphs.make_table(vocab, width)), path, external=True, check=False)
        table_bytes = 4 * vocab * width
        progress(f"tied head {vocab} x {width}: numpy in a child process (OPENBLAS_CORETYPE, L2_SIZE unset)")
        first = child("numpy_matmul", vocab, width, counts, budget, rounds)
        table = make_table(vocab, width) if not any(os.environ.get(k) for k in UNSET) else None  # as in the child
        runner = Runner(path)
        # where the time goes, each at a price in memory: a second, prepacked copy of the table as the head (the
        # untied graph on the same values), and the tied model with the CPU arena on
        packed = os.path.join(folder, f"packed_{vocab}x{width}.onnx")
        graphs.save(graphs.untied_logits(graphs.make_table(vocab, width), graphs.make_table(vocab, width)), packed,
                    external=True, check=False)
        flipped = {"packed": session(packed), "arena": session(path, arena=True)}
        rng = np.random.default_rng(7)
        measured = {}
        for n in counts:
            feeds = {"ids": np.zeros((1, n), np.int64), "hidden": rng.standard_normal((1, n, width)).astype(np.float32)}
            out = {"logits": np.empty((1, n, vocab), np.float32), "embeddings": np.empty((1, n, width), np.float32)}
            contenders = {"run": lambda: runner.run(feeds), "run_out": lambda: runner.run(feeds, out=out)}
            if table is not None:  # numpy here too, raced in the same rounds: a slow spell hits both sides
                h, logits = feeds["hidden"][0], np.empty((n, vocab), np.float32)
                contenders["numpy"] = lambda: np.matmul(h, table.T, out=logits)
            seen = race_rounds(contenders, budget, rounds, settle=SETTLE if table is not None else 0.0)
            measured[n] = {name: min(times) for name, times in seen.items()}
            if table is not None:
                measured[n]["same_round"] = {k: same_round_ratio(seen, k, "numpy") for k in ("run", "run_out")}
            for name, sess in flipped.items():  # alone: a session's pool spins after its run, slowing the next
                measured[n].update(race({name: bound_run(sess, feeds, out)}, budget / 2, rounds))
        runner = flipped = None  # the sessions go before the next size (rebound, not del: the lambdas read them)
        table = None  # the 2 GiB copy goes before the next size
        second = child("numpy_matmul", vocab, width, counts, budget, rounds)
        memory = child("head_memory", path, width, max(counts))
        rows += _rows(vocab, width, counts, first, second, measured)
        held = table_bytes + memory["logits_bytes"]
        rows[-1]["memory"] = {"grown": memory["grown"], "table_bytes": table_bytes,
                              "logits_bytes": memory["logits_bytes"], "ratio": memory["grown"] / held}
        progress(f"tied head {vocab} x {width}: resident after N={max(counts)} runs {memory['grown'] / held:.2f}x "
                 "(table + the logits returned)")
        for saved in (path, packed):
            os.remove(saved)
            os.remove(graphs.storage.data_path(saved))
    return rows


def _rows(vocab, width, counts, first, second, measured):
    """The rows of one size, one per N: numpy's best of its two child runs (`first`, `second`) and of its race here,
    Runner.run's times in `measured`, and the ratios judged."""
    rows = []
    for n in counts:
        numpy_s = min(first["seconds"][str(n)], second["seconds"][str(n)], measured[n].get("numpy", np.inf))
        run, run_out = measured[n]["run"], measured[n]["run_out"]
        same = measured[n].get("same_round")  # judged on these when numpy could race here
        rows.append({"vocab": vocab, "width": width, "tokens": n, "numpy_s": numpy_s, "kernel": first["kernel"],
                     "run_s": run, "run_out_s": run_out,
                     "run_vs_numpy": same["run"][0] if same else run / numpy_s,
                     "run_out_vs_numpy": same["run_out"][0] if same else run_out / numpy_s,
                     "spread": {k: v[1] for k, v in same.items()} if same else None,
                     "flop_per_s": 2 * n * vocab * width / run,
                     "packed_copy_s": measured[n]["packed"], "arena_on_s": measured[n]["arena"]})
        progress(f"tied head {vocab} x {width} N={n}: Runner.run {run * 1e3:.2f} ms, run(out=) "
                 f"{run_out * 1e3:.2f} ms (a packed second table {measured[n]['packed'] * 1e3:.2f}, arena on "
                 f"{measured[n]['arena'] * 1e3:.2f}), numpy ({first['kernel']}) {numpy_s * 1e3:.2f} ms")
    return rows


def bench_floor(budget):
    """e: what one run costs with nothing to compute (Identity on one float), plain and through io_binding."""
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "floor",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    sess = session(model)
    x = np.ones(1, np.float32)
    times = race({"run": lambda: sess.run(None, {"x": x}),
                  "bound": bound_run(sess, {"x": x}, {"y": np.empty(1, np.float32)})}, budget)
    plain, bound = times["run"], times["bound"]
    progress(f"overhead floor: run {plain * 1e6:.1f} us, run_with_iobinding {bound * 1e6:.1f} us")
    return {"run_s": plain, "iobinding_s": bound}
