"""What is tied to what: table/head pairs, and whether two tensors hold the same values."""
import hashlib
from dataclasses import dataclass

import numpy as np

from graphs.arrays import release
from runtime.model.findings import headcodes
from runtime.model.graph import quantized
from runtime.model.read.model import FLOATS, label

BYTES_AT_ONCE = 16 * 2**20  # bytes compared at a time, so a memory-mapped table is never read whole at once


_TILE = 256  # columns of a transposed comparison's tile: both sides' reads stay within a few cache lines a row


def same_values(a, b, transposed=False):
    """Whether 2-D tensors hold the same bytes (b read transposed when asked), a chunk of rows at a time."""
    if a.data_type != b.data_type or a.dims != (b.dims[::-1] if transposed else b.dims):
        return False
    if not transposed:
        return same_bytes(a, b)
    x, y = a.values(), b.values()
    if x is None:  # packed sub-byte codes: a transposed copy cannot be told without unpacking; say no
        return False
    bits = f"u{x.itemsize}" if x.itemsize in (1, 2, 4, 8) else None  # compared as bits: a NaN equals itself
    rows = max(1, BYTES_AT_ONCE // max(1, x.itemsize * x.shape[1]))
    for i in range(0, x.shape[0], rows):  # a block of the table's rows against the same columns of the copy
        xs, ys = x[i:i + rows], y[:, i:i + rows]
        if bits is None:
            if not np.array_equal(xs.view(np.uint8), np.ascontiguousarray(ys.T).view(np.uint8)):
                return False
            continue
        for j in range(0, x.shape[1], _TILE):  # in square-ish tiles, each read where it lies (4x faster than a copy)
            if not np.array_equal(xs[:, j:j + _TILE].view(bits), ys[j:j + _TILE].T.view(bits)):
                return False
        release(xs)  # read once: not held (the copy's columns span its pages: let go at the end)
    release(y)
    return True


def table_shaped(tables, heads):
    """The heads whose vocab x width is some table's: only they can hold a table's values, in whatever layout
    (transposed, quantized blocks: an entry's vocab and width are logical). Every other matmul weight (a layer's)
    is distinct from every table without a byte read."""
    shapes = {(t.vocab, t.width) for t in tables}
    return [h for h in heads if (h.vocab, h.width) in shapes]


@dataclass(frozen=True)
class Pair:
    """A table and a head of the same vocab x width, and how the head holds the table's values (relate()).

    `relation`: `shared` (one stored tensor, whatever view each op takes), `duplicate` or `transposed_duplicate`
    (another initializer with the same values; quantized ones: the same codes and scales in whatever layout),
    `quantized_copy` (a float table and a quantized one holding its values up to rounding, or two quantizations of
    one table), or `distinct`. `wasted_bytes`: the head's bytes where it holds the table's values again; `node`: the
    head's op as the report names it; `via_transpose`: either side read through a Transpose; `table_entry` and
    `head_entry`: the walker's entries (graph.walk); `max_error_in_scales`: a quantized_copy's largest difference,
    in units of the quantized one's scale (of their mean scale where both are quantized: `both_quantized`);
    `table_graph` / `head_graph`: where each is read ("main", or a branch's path); `head_lookup`: for a float table
    and its quantized head, a headcodes.HeadLookup (whether --lookup-from-head can make the lookup read the codes),
    else None."""
    table: str
    head: str
    relation: str
    wasted_bytes: int
    node: str
    via_transpose: bool
    table_entry: dict
    head_entry: dict
    max_error_in_scales: float | None
    both_quantized: bool
    table_graph: str
    head_graph: str
    head_lookup: object

    JSON = ("table", "head", "relation", "wasted_bytes", "max_error_in_scales", "table_graph", "head_graph")

    def as_json(self):
        """What --json says of the pair (Pair.JSON's fields)."""
        return {k: getattr(self, k) for k in self.JSON}


def relate(model, tables, heads):
    """A Pair (its relation said there) for every table and head of the same vocab x width."""
    pairs, digest, values = [], Digests(model), Values()
    by_shape, named, heads = {}, {}, table_shaped(tables, heads)
    for head in heads:
        by_shape.setdefault((head.vocab, head.width), []).append(head)
    for entry in tables + heads:
        named.setdefault((entry.vocab, entry.width), set()).add(entry.initializer)
    # two tensors of a shape (a table and its head): compared straight away, each read once; a fingerprint would
    # read both once more and spare nothing
    fingerprinted = {shape for shape, names in named.items() if len(names) > 2}
    same = _Classes(model, digest, values)  # n tables and n heads of one shape: n^2 pairs, each entry looked at once
    for table in tables:
        for head in by_shape.get((table.vocab, table.width), []):
            transposed = same.as_table(table) != same.as_table(head)
            gap = None
            if head.initializer == table.initializer:
                relation, wasted = "shared", 0
            elif table.quant or head.quant:
                relation, wasted, gap = quantized_relation(model, table, head, transposed)
            elif same(table, head, (table.vocab, table.width) in fingerprinted) \
                    and _same_scales(model, table.scales, head.scales):
                relation, wasted = ("transposed_duplicate" if transposed else "duplicate"), head.bytes
            else:
                relation, wasted = "distinct", 0
            pairs.append(Pair(table.initializer, head.initializer, relation, wasted, same.label(head),
                              head.flips > 0 or table.flips > 0, table, head, gap,
                              bool(table.quant and head.quant), table.graph,
                              head.graph, _head_lookup(model, relation, table, head)))
    return pairs


def _head_lookup(model, relation, table, head):
    """For a float table and its quantized head, a headcodes.HeadLookup (whether --lookup-from-head can make the
    lookup read the head's codes, and why not); for a quantized table and its float head, one that says why no
    share is made; None for every other pair."""
    if relation != "quantized_copy" or bool(table.quant) == bool(head.quant):
        return None
    if table.quant:  # the other way round: never shared
        return headcodes.HeadLookup(headcodes.REVERSE)
    return headcodes.HeadLookup(headcodes.why_not(model, table, head))


class _Classes:
    """Values.same for relate's pairs, with what each entry's pairs ask of it (its orientation, its class of values,
    its node's label) found once for the entry, not once a pair."""

    def __init__(self, model, digests, values):
        self.model, self.digests, self.values, self.known = model, digests, values, {}

    def _fact(self, entry, what, find):
        key = (id(entry), what)
        if key not in self.known:
            self.known[key] = find(entry)
        return self.known[key]

    def as_table(self, entry):
        return self._fact(entry, "as_table", lambda e: e.rows_are_tokens)

    def label(self, entry):
        return self._fact(entry, "label", lambda e: label(e.node))

    def __call__(self, a, b, fingerprint=True):
        """Whether entries `a` and `b` hold the same values (Values.same)."""
        if fingerprint:
            ca, cb = (self._fact(e, "class", lambda e: self.values.of(self.model, self.digests, e)) for e in (a, b))
            if ca is not None and cb is not None:
                return ca == cb
        return self.values.same(self.model, self.digests, a, b, False)  # no fingerprint: compared as they lie


class Digests:
    """Digests(model)(entry): a fingerprint of the entry's values, computed once per initializer a chunk at a time:
    equal values give equal fingerprints, so pairs whose fingerprints differ are distinct without a comparison (in
    one model or across files), and equal ones are compared value by value (same_values). For a 2-D tensor it is
    the sum and the sum of squares of its elements' bits (wrapping), which no layout changes: a table and its
    transposed copy are fingerprinted where they lie, without transposing either. None (compare them) for packed
    codes stored the other way round."""

    def __init__(self, model):
        self.model, self.known = model, {}

    def __call__(self, entry):
        key = (entry.initializer, entry.rows_are_tokens)
        if key not in self.known:
            self.known[key] = self._digest(self.model.tensors[entry.initializer], key[1])
        return self.known[key]

    @staticmethod
    def _digest(tensor, as_table):
        values = tensor.values()
        if values is None or len(tensor.dims) != 2:
            if not as_table:
                return None
            h, raw = hashlib.blake2b(f"{tensor.data_type}".encode(), digest_size=16), tensor.raw()
            for i in range(0, len(raw), BYTES_AT_ONCE):
                h.update(np.ascontiguousarray(raw[i:i + BYTES_AT_ONCE]).data)
            return h.digest()
        size = values.itemsize if values.itemsize in (1, 2, 4, 8) else 1
        words = np.ascontiguousarray(values).reshape(-1).view(f"u{size}")  # as stored: a view, not a copy
        step, total, squares = max(1, BYTES_AT_ONCE // 8), 0, 0
        for i in range(0, len(words), step):
            chunk = words[i:i + step].astype(np.uint64)
            total += int(chunk.sum(dtype=np.uint64))
            squares += int(np.multiply(chunk, chunk, out=chunk).sum(dtype=np.uint64))
            release(words[i:i + step])  # read once: not held
        rows = tuple(tensor.dims) if as_table else tuple(tensor.dims[::-1])
        return tensor.data_type, rows, total % 2**64, squares % 2**64


class Values:
    """Which tables and heads hold the same values, each tensor read at most twice however many it is related to:
    once for its fingerprint (Digests), once against the first tensor of that fingerprint (same_values). Holding
    the same values is an equivalence, so two entries hold the same values exactly when they are of one class:
    relating n entries costs n reads, not n^2 comparisons (many equal tables in one file, or many files)."""

    def __init__(self):
        self.classes, self.firsts = {}, {}  # (id(tensor), as_table) -> class; fingerprint -> [(tensor, as_table, class)]

    def of(self, model, digests, entry):
        """The class of `entry` (a table or head of `model`, fingerprinted by `digests`), or None where there is no
        fingerprint (packed codes stored the other way round: told apart by nothing short of unpacking)."""
        tensor, as_table = model.tensors[entry.initializer], entry.rows_are_tokens
        key = (id(tensor), as_table)
        if key not in self.classes:
            digest = digests(entry)
            found = None
            if digest is not None:
                firsts = self.firsts.setdefault(digest, [])
                found = next((number for first, first_as_table, number in firsts
                              if same_values(first, tensor, transposed=first_as_table != as_table)), None)
                if found is None:
                    found = len(self.classes) + 1
                    firsts.append((tensor, as_table, found))
            self.classes[key] = found
        return self.classes[key]

    def same(self, model, digests, a, b, fingerprint=True):
        """Whether entries `a` and `b` of `model` hold the same values (as stored or one transposed). `fingerprint`
        False: compared straight away (the only two tensors of their shape: a class would cost a read more)."""
        ca, cb = (self.of(model, digests, a), self.of(model, digests, b)) if fingerprint else (None, None)
        if ca is None or cb is None:  # no fingerprint: compared as they lie
            return same_values(model.tensors[a.initializer], model.tensors[b.initializer],
                               transposed=a.rows_are_tokens != b.rows_are_tokens)
        return ca == cb


ROUNDING = 1 + 2**-10  # half a scale rounding to nearest, up to one where a code range [-8, 7] clips its edge (MLAS)


def _float_rows(model, entry):
    """A float table or head's values [vocab, width] (a memory-mapped view), or None for another type."""
    tensor = model.tensors[entry.initializer]
    if tensor.data_type not in FLOATS or len(tensor.dims) != 2:
        return None
    values = tensor.values()
    return values if entry.rows_are_tokens else values.T


def quantized_relation(model, table, head, transposed):
    """(relation, wasted bytes, difference in scales) of a pair where one side or both are quantized: `table` and
    `head` entries of `model` (whose tensors may be two files', folder.relate_files)."""
    a, b = table.quant, head.quant
    if a and b:
        mine = {b.codes, b.scale, b.zero_point} - {a.codes, a.scale, a.zero_point, None}  # the head's own tensors
        wasted = sum(model.tensors[n].nbytes for n in mine if n in model.tensors)
        if quantized.same_quantized(model, a, b, table.vocab):
            return ("transposed_duplicate" if transposed else "duplicate"), wasted, None
        gap = quantized.gap_between(model, a, b, table.vocab)  # two quantizations of one float table?
        if gap is not None and gap <= ROUNDING:
            return "quantized_copy", wasted, round(gap, 4)
        return "distinct", 0, None
    rows = _float_rows(model, head if a else table)
    gap = None if rows is None else quantized.gap(model, rows, a or b, table.vocab)
    if gap is not None and gap <= ROUNDING:
        return "quantized_copy", 0, round(gap, 4)
    return "distinct", 0, None


def _same_scales(model, a, b):
    if a == b:
        return True
    return a is not None and b is not None and same_values(model.tensors[a], model.tensors[b])


def same_bytes(a, b):
    """Whether two tensors hold the same stored bytes, compared a chunk at a time (none read when their sizes
    differ: an optimized model's hundreds of folded constants are each checked against every table)."""
    if a.nbytes != b.nbytes:
        return False
    x, y = a.raw(), b.raw()
    if len(x) != len(y):
        return False
    for i in range(0, len(x), BYTES_AT_ONCE):
        if not np.array_equal(x[i:i + BYTES_AT_ONCE], y[i:i + BYTES_AT_ONCE]):
            return False
        if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):  # read once: not held
            release(x[i:i + BYTES_AT_ONCE])
            release(y[i:i + BYTES_AT_ONCE])
    return True
