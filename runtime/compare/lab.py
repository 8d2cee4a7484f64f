"""What every check shares: the configuration, the reference tables, float32 bounds, and the Check record."""
import os
import sys
import time
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from types import SimpleNamespace

import numpy as np

import embed
import graphs
from graphs.export import build_all
from runtime.compare.parallel import Worker, quiet, stretched_table, table_passes
from runtime.runner import Runner, optimized_model

U = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53  # float64's, for the reference's own arithmetic


def gamma(n):
    """Higham's gamma_n: the relative bound on n float32 roundings in a row."""
    return n * U / (1 - n * U)


@dataclass
class Check:
    name: str
    graph: str
    passed: bool | None  # None: the claim does not apply to the inputs chosen
    detail: str
    diff: float | None = None
    tolerance: float | None = None
    values: dict = field(default_factory=dict)

    @property
    def figure(self):
        """A measured figure reported beside the checks, not a verdict."""
        return bool(self.values.get("figure"))

    def line(self):
        status = "INFO" if self.figure else {True: "PASS", False: "FAIL", None: "N/A "}[self.passed]
        measured = "" if self.diff is None else f" | diff {self.diff:.3g} (tolerance {self.tolerance:.3g})"
        return f"{status} | {self.name:<16} | {self.graph:<16} | {self.detail}{measured}"


def as64(values):
    return np.asarray(values, dtype=np.float64)


def differing(a, b):
    """How many values differ in their bits (float32 graph output against float32-exact reference floats)."""
    a, b = as64(a), as64(b)
    if a.shape != b.shape:
        return max(a.size, b.size)
    return int(np.count_nonzero(a.view(np.uint64) != b.view(np.uint64)))


def within(got, exact, bound):
    """(passed, max |diff|, worst diff / bound); NaN never passes."""
    got, exact, bound = as64(got), as64(exact), as64(bound)
    diff = np.abs(got - exact)
    ok = bool(np.all(diff <= bound)) and not np.isnan(got).any()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(diff == 0, 0.0, diff / bound)  # a difference against a zero bound is infinitely over
    return ok, float(np.max(diff)), float(np.max(ratio))  # NaN shows as nan in both


def dot_bounds(rows, vectors, absolute=False):
    """gamma_w * sum|a_i b_i| for every row against every vector: (len(vectors), len(rows)); absolute=True says
    `rows` already holds |rows| in float64 (a caller asking many times keeps it).

    A tolerance, not a reference value, so float64 BLAS computes it: each |a_i b_i| of float32 values is exact in
    float64 and a sum of w non-negative terms is off by at most gamma_w in float64, so inflating by
    (1 + 2 (w + 2) u64) keeps it an upper bound on the exact gamma_w * sum|a_i b_i|.
    """
    rows, vectors = (rows if absolute else np.abs(as64(rows))), np.abs(as64(vectors))
    width = rows.shape[1]
    return gamma(width) * (vectors @ rows.T) * (1 + 2 * (width + 2) * U64)


def _head_reference(vocab, width, seed, hidden):
    """The untied head's reference table and logits (pure Python), with their bounds."""
    head = embed.make_table(vocab, width, seed)
    return [embed.logits(head, h) for h in hidden], dot_bounds(head, hidden)


class Progress:
    """'[12.3 s] stage' on one refreshed stderr line, only when stderr is a terminal and the report is not JSON."""

    def __init__(self, enabled):
        self.enabled, self.start, self.width = enabled and sys.stderr.isatty(), time.monotonic(), 0

    def __call__(self, stage):
        if self.enabled:
            text = f"[{time.monotonic() - self.start:5.1f} s] {stage}"
            sys.stderr.write("\r" + text.ljust(self.width))
            sys.stderr.flush()
            self.width = len(text)

    def done(self):
        if self.enabled and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


class Lab:
    """The configuration, the reference tables (pure Python, each computed once), and one place to put files."""

    def __init__(self, args, folder, progress=lambda stage: None, background=()):
        self.vocab, self.width, self.seed = args.vocab_size, args.width, args.seed
        self.ids, self.query, self.k = args.ids, args.query, args.k
        self.formats = getattr(args, "formats", embed.FORMATS)
        self.block_size = getattr(args, "block_size", None)
        self.folder, self.progress, self._memo, self._labels = folder, progress, {}, {}
        self._workers = []
        self.hidden = embed.make_table(4, self.width, self.seed + 2)  # float32-exact hidden vectors
        # While this process makes the table, a second one makes the untied head's reference and runs the
        # `background` checks, which only build and save graphs.
        config = SimpleNamespace(vocab=self.vocab, width=self.width, seed=self.seed, folder=folder,
                                 progress=quiet)
        self._workers.append(Worker([(("head",), _head_reference, (self.vocab, self.width, self.seed + 1, self.hidden))]
                                 + [((check.__name__,), check, (config,)) for check in background]))
        progress(f"reference table: embed.make_table({self.vocab}, {self.width}) in pure Python")
        self.table = embed.make_table(self.vocab, self.width, self.seed)  # the truth, in Python floats
        self.table64 = as64(self.table)  # the same values, for bounds
        self.table32 = self.table64.astype(np.float32)  # exact: every value is a float32
        self.stretch, self.factor, self.user_factor = args.stretch, args.factor, args.factor is not None
        if self.stretch is None:  # the best dot neighbour that does not already lead
            ranked = self.neighbors(self.table, "dot")
            self.stretch = ranked[1] if len(ranked) > 1 else ranked[0]
        if self.factor is None:
            self.factor = self.lead(beat_query=False) or 2.0
        # The reference's passes over the table that later checks need run in a second process meanwhile.
        self._shared = shared_memory.SharedMemory(create=True, size=self.table64.nbytes)
        np.ndarray(self.table64.shape, np.float64, self._shared.buf)[:] = self.table64
        work = list(self._table_work())
        self._workers.append(Worker([(None, table_passes, (self._shared.name, self.table64.shape, self.query,
                                                             self.stretch, work))], [w[0] for w in work]))
        progress("building the seven graphs")
        self.models = build_all(self.vocab, self.width, self.seed)  # graphs build from graphs.make_table
        self.runners = {}

    def _table_work(self):
        """(memo key, what, table factor, argument) for the second process, in the order the checks ask."""
        yield ("onehot",), "onehot", None, list(dict.fromkeys(self.ids))
        yield ("neighbors", "table", "cosine"), "neighbors", None, "cosine"
        for metric in ("dot", "cosine"):
            yield ("neighbors", ("stretched", self.factor), metric), "neighbors", self.factor, metric
        for token in dict.fromkeys(self.ids):
            yield ("logits", "table", token), "logits", None, token
        top = self.factor if self.user_factor else self.lead(beat_query=True)
        if top is not None:
            yield ("logits", ("stretched", top), self.query), "logits", top, self.query

    def onehot(self):
        """embed.onehot_lookup(table, ids), asked once per distinct id (a repeated id is the same product again)."""
        distinct = list(dict.fromkeys(self.ids))
        rows = dict(zip(distinct, self.memo(("onehot",), lambda: embed.onehot_lookup(self.table, distinct))))
        return [rows[i] for i in self.ids]

    def lead(self, beat_query):
        """embed.stretch_to_lead(table, query, stretch, beat_query)'s rule (the smallest power of two > 1 that puts
        the stretched token strictly ahead of its rivals, None if it points away), on the memoised
        embed.logits(table, table[query]) rather than another pass over the table. It only picks a factor: every
        claim is then checked on embed.stretch_row and embed.neighbors."""
        scores = self.logits(self.table, self.query)
        score = scores[self.stretch]
        if score <= 0:
            return None
        best = max((v for t, v in enumerate(scores) if t != self.stretch and (beat_query or t != self.query)),
                   default=0.0)
        factor = 2.0
        while factor * score <= best:
            factor *= 2.0
        return factor

    def model(self, name):
        return self.models[f"{name}.onnx"]

    def saved(self, name, model=None):
        """The path of graph `name` (or of `model`, under that name) saved once with its tables as external data,
        so that each session maps them from the file rather than parsing and copying a serialized model."""
        path = os.path.join(self.folder, f"{name}.onnx")
        if not os.path.exists(path):
            graphs.save(self.model(name) if model is None else model, path, external=True, check=False)
        return path

    def runner(self, name, model=None):
        """One session per graph, made on first use: an exported graph by name, or `model` under a new name."""
        if name not in self.runners:
            self.runners[name] = Runner(self.saved(name, model))
        return self.runners[name]

    def model_at(self, name, fmt, block_size):
        """Graph `name` built on this lab's table stored in `fmt`, once."""
        return self.memo(("model", name, fmt, block_size),
                         lambda: getattr(graphs, name)(self.table32, fmt=fmt, block_size=block_size))

    def neighbors_at(self, fmt, block_size, factor=None):
        """The session of the cosine neighbours graph on this lab's table stored in `fmt` (with the stretched row
        times `factor`, if given), built once."""
        name = f"neighbors_cosine@{fmt}-{block_size}" + (f"x{factor:g}" if factor else "")
        if name not in self.runners:
            table = self.table32
            if factor:
                table = table.copy()
                table[self.stretch] *= np.float32(factor)
            return self.runner(name, graphs.neighbors(table, "cosine", fmt=fmt, block_size=block_size))
        return self.runners[name]

    def head32(self):
        """The untied head's table, as graphs makes it (seed + 1)."""
        return self.memo(("head32",), lambda: graphs.make_table(self.vocab, self.width, self.seed + 1))

    def optimized(self, name):
        return optimized_model(self.saved(name), self.folder, f"{name}.optimized.onnx")

    def memo(self, key, compute):
        """compute() once per key (or what the second process computed for that key): the reference's answers are
        reused, never recomputed."""
        if key not in self._memo:
            worker = next((w for w in self._workers if key in w.tasks), None)
            self._memo[key] = worker.result(key, self.progress) if worker else compute()
        return self._memo[key]

    def label(self, table):
        """'table', or ('stretched', factor) for a table made by stretched(): how memo keys name a table."""
        return "table" if table is self.table else self._labels[id(table)]

    def stretched(self, factor):
        """embed.stretch_row(table, stretch, factor), once per factor."""
        table = self.memo(("stretched", factor), lambda: stretched_table(self.table, self.stretch, factor))
        self._labels[id(table)] = ("stretched", factor)
        return table

    def stretched32(self, table):
        """`table` (ours or a stretch of it) as the float32 array a graph stores: ours, with the one row replaced."""
        values = self.table32.copy()
        values[self.stretch] = np.asarray(table[self.stretch], dtype=np.float32)
        return values

    def neighbors(self, table, metric, k=None):
        """embed.neighbors(table, query, k, metric) (k=None: every other token, ranked). Asked once per table and
        metric for the whole ranking: a top k is by definition its first k."""
        ranked = self.memo(("neighbors", self.label(table), metric),
                           lambda: embed.neighbors(table, self.query, self.vocab, metric))
        return ranked if k is None else ranked[:k]

    def logits(self, table, token):
        """embed.logits(table, table[token]): every token's dot product with `token`, once per table and token."""
        return self.memo(("logits", self.label(table), token), lambda: embed.logits(table, table[token]))

    def _patched(self, table, values, row_value):
        """`values` (one per row of our table), with the stretched row's entry recomputed when `table` is a stretch:
        a stretch changes one row, so no copy of the whole table is needed."""
        if table is not self.table:
            values = values.copy()
            values[self.stretch] = row_value(as64(table[self.stretch]))
        return values

    def dot_bound(self, table, vector):
        """gamma_w * sum|a_i b_i| of each row of `table` (this lab's table or a stretch of it) against `vector`."""
        absolute = self.memo(("abs64",), lambda: np.abs(self.table64))
        return self._patched(table, dot_bounds(absolute, [vector], absolute=True)[0],
                             lambda row: dot_bounds([row], [vector])[0, 0])

    def cosine_bound(self, table, vector, cosines):
        """The float32 bound of each cosine in `cosines` {token: reference cosine} of `table`'s rows with `vector`:
        the dot's bound over the norms, plus gamma_(w+4) |cos| for the norms' sums, square roots, product and
        division. Norms here are float64 (a tolerance, not a reference value), deflated to keep the bound upper."""
        dots = self.dot_bound(table, vector)
        shrink = 1 - 2 * (self.width + 2) * U64
        norms = self._patched(table, self.memo(("norms64",), lambda: np.sqrt(np.einsum("ij,ij->i", self.table64,
                                                                                        self.table64))),
                              lambda row: np.sqrt(row @ row)) * shrink
        query = np.sqrt(np.dot(as64(vector), as64(vector))) * shrink
        return {t: dots[t] / (norms[t] * query) + gamma(self.width + 4) * abs(c) for t, c in cosines.items()}

    def result(self, name):
        """The result of background check `name` (run in the second process)."""
        return self.memo((name,), None)

    def head_reference(self):
        """(embed.logits(head, h) for each hidden vector, their bounds)."""
        return self.memo(("head",), None)

    def close(self):
        for worker in self._workers:
            worker.close()
        if hasattr(self, "_shared"):
            self._shared.close()
            self._shared.unlink()
