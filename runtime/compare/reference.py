"""The truth for one run: embed's answers on this configuration's table, each computed once on explicit arguments.

A table is named by the stretch factor applied to its row `stretch` (None: the table itself). The passes over
the whole table that checks will ask for are started in the second process at once (runtime.compare.pool); the
reference implementation is passed in (`impl`, default embed) and the second process loads the same one, so a
test that breaks one of its functions sees the check that uses it fail, whichever process computed it.
"""
import functools
import importlib
import importlib.util
import sys
from multiprocessing import resource_tracker, shared_memory
from typing import NamedTuple

import numpy as np

import embed
from runtime.bounds import as64, dot_bounds
from runtime.compare.pool import Pool, quiet


def _load(spec):
    """The reference module named by spec (name, file): imported by name, else from its file."""
    name, path = spec
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ImportError:
        loader = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
        sys.modules[name] = module
        return module


_TABLES = {}  # in the second process: the reference table read once from shared memory, and its stretches


def _attach(name):
    """The shared memory `name`, attached without telling multiprocessing's resource tracker (before 3.13 attaching
    registers it there too). Its creator registers it and unlinks it, unregistering it, once: a worker that opened
    it just before the unlink registered it just after (a failed run, ending as the worker starts a pass), and the
    tracker warned at exit of a leaked object, in four lines on stderr, and unlinked it again."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # 3.13 and later
    except TypeError:
        pass
    register = resource_tracker.register
    resource_tracker.register = lambda *args: None  # this process runs one task at a time
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class _Source(NamedTuple):
    """Where the second process finds the table: the reference module's spec (name, file), the shared memory's name
    and the shape of the float64 table in it, and the row a stretch changes."""
    spec: tuple
    shared: str
    shape: tuple
    stretch: int


def _table_in_worker(source, factor):
    impl = _load(source.spec)
    if None not in _TABLES:
        memory = _attach(source.shared)
        _TABLES[None] = np.ndarray(source.shape, np.float64, memory.buf).tolist()  # float64 round-trips them exactly
        memory.close()
    if factor not in _TABLES:
        _TABLES[factor] = stretched_table(impl, _TABLES[None], source.stretch, factor)
    return impl, _TABLES[factor]


def table_pass(impl, table, query, what, argument):
    """One pure-Python pass over `table`: impl.onehot_lookup of ids, impl.neighbors of `query` (every other token,
    ranked) by a metric, or impl.logits against one of its rows."""
    if what == "onehot":
        return impl.onehot_lookup(table, list(argument))
    if what == "neighbors":
        return impl.neighbors(table, query, len(table), argument)
    return impl.logits(table, table[argument])


def _pass_in_worker(source, factor, query, what, argument):
    impl, table = _table_in_worker(source, factor)
    return table_pass(impl, table, query, what, argument)


def stretched_table(impl, table, token, factor):
    """impl.stretch_row(table, token, factor), made by stretch_row on the one row it changes: the other rows are
    already floats, so they are shared rather than copied (38 million values copied take seconds)."""
    rows = list(table)
    rows[token] = impl.stretch_row([table[token]], 0, factor)[0]
    return rows


def head_reference(spec, vocab, width, seed, hidden):
    """The untied head's reference logits for each hidden vector (pure Python), with their bounds."""
    impl = _load(spec)
    head = impl.make_table(vocab, width, seed)
    return [impl.logits(head, h) for h in hidden], dot_bounds(head, hidden)


class Reference:
    """embed's answers for `config`'s table, memoised on their arguments. The table the second process reads is the
    pool's to free (Pool.share)."""

    def __init__(self, config, pool=None, impl=embed, progress=quiet):
        self.config, self.embed, self.progress = config, impl, progress
        self.pool = pool or Pool(enabled=False)
        self._memo = {}
        self._spec = (impl.__name__, getattr(impl, "__file__", None))
        vocab, width, seed = config.vocab, config.width, config.seed
        self.hidden = impl.make_table(4, width, seed + 2)  # float32-exact hidden vectors
        # while this process makes the table, the second one makes the untied head's reference
        self.pool.submit(("head",), head_reference, (self._spec, vocab, width, seed + 1, self.hidden),
                         lambda: head_reference(self._spec, vocab, width, seed + 1, self.hidden))
        progress(f"reference table: embed.make_table({vocab}, {width}) in pure Python")
        self.table = impl.make_table(vocab, width, seed)  # the truth, in Python floats
        self.table64 = as64(self.table)  # the same values, for bounds
        self.table32 = self.table64.astype(np.float32)  # exact: every value is a float32
        self.magnitudes = Magnitudes(self.table64)
        self.stretch = config.stretch
        if self.stretch is None:  # the best dot neighbour that does not already lead
            ranked = self.neighbors("dot")
            self.stretch = ranked[1] if len(ranked) > 1 else ranked[0]
        self.user_factor = config.factor is not None
        self.factor = config.factor if self.user_factor else (self.lead(beat_query=False) or 2.0)
        _start_passes(self)

    def _memoised(self, key, compute):
        if key not in self._memo:
            self._memo[key] = self.pool.result(key, self.progress) if key in self.pool else compute()
        return self._memo[key]

    # --- the answers -------------------------------------------------------------------------------------------

    def at(self, factor=None):
        """The table (factor None), or embed.stretch_row(table, stretch, factor), once per factor."""
        if factor is None:
            return self.table
        return self._memoised(("stretched", factor), lambda: stretched_table(self.embed, self.table, self.stretch,
                                                                             factor))

    def at32(self, factor=None):
        """at(factor) as the float32 array a graph stores: the table, with the stretched row replaced."""
        if factor is None:
            return self.table32
        values = self.table32.copy()
        values[self.stretch] = np.asarray(self.at(factor)[self.stretch], dtype=np.float32)
        return values

    def lookup(self, ids):
        """embed.lookup(table, ids)."""
        return self.embed.lookup(self.table, list(ids))

    def onehot(self, ids):
        """embed.onehot_lookup(table, ids), computed once per distinct id (a repeated id is the same product)."""
        distinct = tuple(dict.fromkeys(ids))
        rows = dict(zip(distinct, self._memoised(("onehot", distinct),
                                                 lambda: table_pass(self.embed, self.table, None, "onehot", distinct))))
        return [rows[i] for i in ids]

    def neighbors(self, metric, k=None, factor=None):
        """embed.neighbors(at(factor), query, k, metric) (k None: every other token, ranked), once per table and
        metric for the whole ranking: a top k is by definition its first k."""
        ranked = self._memoised(("neighbors", factor, metric),
                                lambda: self.embed.neighbors(self.at(factor), self.config.query, self.config.vocab,
                                                             metric))
        return ranked if k is None else ranked[:k]

    def logits(self, token, factor=None):
        """embed.logits(at(factor), at(factor)[token]): every token's dot product with `token`."""
        table = self.at(factor)
        return self._memoised(("logits", factor, token), lambda: self.embed.logits(table, table[token]))

    def hidden_logits(self):
        """embed.logits(table, h) for each hidden vector."""
        return self._memoised(("hidden",), lambda: [self.embed.logits(self.table, h) for h in self.hidden])

    def head_logits(self):
        """(embed.logits(head, h) for each hidden vector, their bounds): the untied head's reference (seed + 1)."""
        return self._memoised(("head",), None)

    def lead(self, beat_query):
        """embed.stretch_to_lead's rule on the memoised logits of the query: the smallest power of two > 1 that puts
        the stretched token strictly ahead of its rivals (and of the query too when `beat_query`), None if it points
        away. It only picks a factor: every claim is then checked on embed.stretch_row and embed.neighbors."""
        scores = self.logits(self.config.query)
        return self.embed.lead_factor(scores, self.config.query, self.stretch, beat_query)


def _start_passes(self):
    """The passes later checks of Reference `self` ask for, in the order they ask, to the second process."""
    if not self.pool.enabled:
        return
    shared = self.pool.share(self.table64)
    distinct = tuple(dict.fromkeys(self.config.ids))
    work = [(("onehot", distinct), None, "onehot", distinct), (("neighbors", None, "cosine"), None, "neighbors", "cosine")]
    work += [(("neighbors", self.factor, metric), self.factor, "neighbors", metric) for metric in ("dot", "cosine")]
    work += [(("logits", None, token), None, "logits", token) for token in distinct]
    top = self.factor if self.user_factor else self.lead(beat_query=True)
    if top is not None:
        work.append((("logits", top, self.config.query), top, "logits", self.config.query))
    source = _Source(self._spec, shared, self.table64.shape, self.stretch)
    for key, factor, what, argument in work:
        if key in self._memo:
            continue
        args = (source, factor, self.config.query, what, argument)
        self.pool.submit(key, _pass_in_worker, args,
                         lambda f=factor, w=what, a=argument: table_pass(self.embed, self.at(f), self.config.query,
                                                                       w, a))


class Magnitudes:
    """The table's magnitudes the bounds are made of, in float64, each computed once (tolerances, not reference
    values): `abs64` |table|, `norms64` the norm of every row."""

    def __init__(self, table64):
        self.table64 = table64

    @functools.cached_property
    def abs64(self):
        return np.abs(self.table64)

    @functools.cached_property
    def norms64(self):
        return np.sqrt(np.einsum("ij,ij->i", self.table64, self.table64))
