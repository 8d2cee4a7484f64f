"""What the bench measures in a fresh process, one function each: python -m runtime.bench.probes NAME ARGS_JSON
prints the function's answer as JSON. A fresh process, so that memory another measurement freed, or numpy's BLAS
settings, are not counted in this one."""
import ctypes
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np

from graphs.table import make_table
from runtime.bench.timing import race, rss
from runtime.runner import Runner

UNSET = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")  # only for numpy's child: tests and CI keep the machine's


def numpy_matmul(vocab, width, counts, budget, rounds):
    """numpy's best 2-D matmul on the table for each N, and the kernel OpenBLAS picked (read from the library)."""
    table = make_table(vocab, width)
    best = {}
    for n in counts:
        h = np.random.default_rng(n).standard_normal((n, width)).astype(np.float32)
        out = np.empty((n, vocab), np.float32)
        times = race({"matmul": lambda: h @ table.T, "matmul_out": lambda: np.matmul(h, table.T, out=out)},
                     budget, rounds)
        best[n] = min(times.values())
    kernel = "unknown"
    for lib in glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*")):
        blas = ctypes.CDLL(lib)
        for name in ("scipy_openblas_get_corename64_", "openblas_get_corename"):
            if hasattr(blas, name):
                getattr(blas, name).restype = ctypes.c_char_p
                kernel = getattr(blas, name)().decode()
    return {"seconds": best, "kernel": kernel}


def head_memory(path, width, n):
    """Resident growth after three N-token runs of the tied head, the last run's logits still held."""
    feeds = {"ids": np.zeros((1, n), np.int64), "hidden": np.ones((1, n, width), np.float32)}
    before = rss()
    runner = Runner(path)
    kept = [runner.run(feeds) for _ in range(3)][-1]  # the logits a caller holds after its runs
    return {"grown": rss() - before, "logits_bytes": kept["logits"].nbytes}


def session_memory(path, width, arena):
    """(bytes at start, bytes after a 64-token run, seconds of a later run) of a session with the Runner's settings."""
    before = rss()
    runner = Runner(path, arena=arena)
    start = rss()
    feeds = {"ids": np.zeros((1, 3), np.int64), "hidden": np.ones((1, 64, width), np.float32)}
    runner.run(feeds)
    after = rss() - before
    times = []
    for _ in range(3):  # after the memory figure: these runs' own allocations do not count in it
        t = time.perf_counter()
        runner.run(feeds)
        times.append(time.perf_counter() - t)
    return [start - before, after, min(times)]


def session_growth(path, width, n=64, disabled_optimizers=()):
    """What a session on the tied head adds after an n-token run under onnxruntime's default SessionOptions
    (`disabled_optimizers` skipped)."""
    from runtime.resident import session_growth as grown
    return grown(path, {"ids": np.zeros((1, n), np.int64), "hidden": np.ones((1, n, width), np.float32)},
                 disabled_optimizers=disabled_optimizers)


PROBES = {"numpy_matmul": numpy_matmul, "head_memory": head_memory, "session_memory": session_memory,
          "session_growth": session_growth}


def child(name, *args):
    """PROBES[name](*args) in a fresh process (numpy's with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset)."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    done = subprocess.run([sys.executable, "-m", "runtime.bench.probes", name, json.dumps(args)], capture_output=True,
                          text=True, env=env, check=True)
    return json.loads(done.stdout)


if __name__ == "__main__":
    print(json.dumps(PROBES[sys.argv[1]](*json.loads(sys.argv[2]))))
