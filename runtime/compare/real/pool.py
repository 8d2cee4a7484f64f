"""The pure-Python reference's passes over a real table, in worker processes beside the graphs and the figures.

embed.py reads the table a row at a time (rows.Rows); over 151936 x 896 values each pass takes about a minute, and
a run needs a dozen. Each worker opens the lab's data file as a memory map (the same pages the sessions read), so
the passes run two at a time on two cores while this process runs the graphs and the self-scores. Workers come
from a forkserver: forking a process whose onnxruntime threads may hold locks can leave the child waiting forever.
"""
import multiprocessing
import os

import numpy as np

import embed
from runtime.compare.real.rows import Rows

_ROWS = None  # in a worker: the table


def _open(path, shape):
    global _ROWS
    _ROWS = Rows(np.memmap(path, np.float32, "r", shape=tuple(shape)))


def _pass(what, query, argument, stretch):
    """One pass in a worker: embed.neighbors of `query` (argument: (k, metric)), embed.onehot_lookup of ids, or
    embed.logits against the query's row; `stretch`: (token, factor) of a stretched row, or None."""
    rows = _ROWS if stretch is None else _ROWS.stretched(*stretch)
    if what == "neighbors":
        return embed.neighbors(rows, query, *argument)
    if what == "onehot":
        return embed.onehot_lookup(rows, list(argument))
    return embed.logits(rows, rows[query])


class ReferencePool:
    """submit(what, query, argument, stretch) -> an AsyncResult whose get() is _pass's answer; close() ends the
    workers (terminate: a pass is pure, nothing is left half-done)."""

    def __init__(self, data, shape, workers=None):
        context = multiprocessing.get_context("forkserver")
        self._pool = context.Pool(workers or max(1, min(2, os.cpu_count() or 1)), _open, (data, list(shape)))

    def submit(self, what, query=None, argument=None, stretch=None):
        return self._pool.apply_async(_pass, (what, query, argument, stretch))

    def close(self):
        self._pool.terminate()
        self._pool.join()
