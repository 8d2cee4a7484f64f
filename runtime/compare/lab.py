"""What every check shares: the configuration, the reference tables (computed once, some in a second process)."""
import multiprocessing
import os
import sys
import time
from multiprocessing import shared_memory
from types import SimpleNamespace

import numpy as np

import embed
import graphs
from graphs.export import build_all
from runtime.compare.bounds import U64, as64, dot_bounds, gamma
from runtime.compare.parallel import Worker, claim, quiet, stretched_table, table_pass, table_passes
from runtime.runner import Runner, optimized_model

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
        self._workers, self._work, self._passer = [], [], None
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
        # The reference's passes over the table that later checks need run in a second process meanwhile; this one
        # takes the passes nobody has started when it would otherwise wait (see _table_pass).
        self._shared = shared_memory.SharedMemory(create=True, size=self.table64.nbytes)
        np.ndarray(self.table64.shape, np.float64, self._shared.buf)[:] = self.table64
        self._work = list(self._table_work())
        self._claims = multiprocessing.get_context("forkserver").Array("b", len(self._work))
        self._passer = Worker([(None, table_passes, (self._shared.name, self.table64.shape, self.query, self.stretch,
                                                     self._work, self._claims))], [w[0] for w in self._work])
        self._workers.append(self._passer)
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

    def stored(self, fmt, block_size):
        """This lab's table quantized to `fmt` once (graphs.precision.store), for every graph in that format."""
        return self.memo(("stored", fmt, block_size), lambda: graphs.precision.store(self.table32, fmt, block_size))

    def model_at(self, name, fmt, block_size):
        """Graph `name` built on this lab's table stored in `fmt`, once."""
        return self.memo(("model", name, fmt, block_size),
                         lambda: getattr(graphs, name)(self.stored(fmt, block_size), fmt=fmt, block_size=block_size))

    def neighbors_at(self, fmt, block_size, factor=None):
        """The session of the cosine neighbours graph on this lab's table stored in `fmt` (with the stretched row
        times `factor`, if given, re-quantized alone), built once."""
        name = f"neighbors_cosine@{fmt}-{block_size}" + (f"x{factor:g}" if factor else "")
        if name not in self.runners:
            table = self.stored(fmt, block_size)
            if factor:
                table = table.with_row(self.stretch, self.table32[self.stretch] * np.float32(factor))
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
            if self._passer is not None and key in self._passer.tasks:
                self._memo[key] = self._table_pass(key)
            else:
                worker = next((w for w in self._workers if key in w.tasks), None)
                self._memo[key] = worker.result(key, self.progress) if worker else compute()
        return self._memo[key]

    def _table_pass(self, key):
        """A reference pass shared with the second process: run here if that process has not taken it; else, until
        its answer comes, run the last passes nobody has taken yet (they are needed later), then wait for it."""
        keys = [w[0] for w in self._work]
        index = keys.index(key)
        if claim(self._claims, index):
            return self._run_pass(index)
        while not self._passer.ready(key):
            free = next((i for i in reversed(range(len(keys))) if keys[i] not in self._memo
                         and claim(self._claims, i)), None)
            if free is None:
                break
            self._memo[keys[free]] = self._run_pass(free)
        return self._passer.result(key, self.progress)

    def _run_pass(self, index):
        key, what, factor, argument = self._work[index]
        self.progress(f"{key[0]} here, while the second process works")
        return table_pass(self.table if factor is None else self.stretched(factor), self.query, what, argument)

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
