"""The pure-Python reference's passes over a real table, in worker processes beside the graphs and the figures.

embed.py reads the table a row at a time (rows.Rows); over 262144 x 640 values a pass takes 8 to 25 s, and a run
needs five: the queries' scores by both metrics (the first query's apart, its stretch waits on it), each one-hot
id's product, the stretched row's lists. Each worker opens the lab's data file as a memory map (the same pages the
sessions read), so the passes run two at a time on two cores while this process runs the graphs and the
self-scores. Workers come
from a forkserver: forking a process whose onnxruntime threads may hold locks can leave the child waiting forever.
"""
import multiprocessing
import os

import numpy as np

import embed
from graphs.arrays import release
from runtime.compare.real.rows import Rows

_ROWS = None  # in a worker: the table


def _open(path, shape):
    global _ROWS
    _ROWS = Rows(np.memmap(path, np.float32, "r", shape=tuple(shape)))


def _pass(what, queries, argument, stretch):
    """One pass in a worker: "scores", embed.scores_of `queries` ranked by both metrics ({query: {"cosine",
    "dot"}: its `k` neighbours}, argument (k, with_logits): with its dot scores too, embed.logits of its row, as
    "logits"), or "onehot", embed.onehot_lookup of the ids `argument`; `stretch`: (token, factor) of a stretched
    row, or None."""
    rows = _ROWS if stretch is None else _ROWS.stretched(*stretch)
    try:
        if what == "onehot":
            return embed.onehot_lookup(rows, list(argument))
        k, with_logits = argument
        found = {}
        for query, scores in embed.scores_of(rows, queries, zero_rows=True).items():  # padding rows: no cosine
            found[query] = {metric: embed.ranked(scores[metric], query, k) for metric in ("cosine", "dot")}
            if with_logits:
                found[query]["logits"] = scores["dot"]
        return found
    finally:
        release(_ROWS.values)  # an idle worker holds none of the table's pages


class ReferencePool:
    """submit(what, queries, argument, stretch) -> an AsyncResult whose get() is _pass's answer; close() ends the
    workers (terminate: a pass is pure, nothing is left half-done)."""

    def __init__(self, data, shape, workers=None):
        context = multiprocessing.get_context("forkserver")
        self._pool = context.Pool(workers or max(1, min(2, os.cpu_count() or 1)), _open, (data, list(shape)))

    def submit(self, what, queries=None, argument=None, stretch=None):
        return self._pool.apply_async(_pass, (what, queries, argument, stretch))

    def close(self):
        self._pool.terminate()
        self._pool.join()
