"""The reference: an embedding table, lookups into it, and scores out of it, in the standard library only.

A token id picks one row of a `vocab_size x width` table. Multiplying a one-hot vector by the
table gives the same row with every product done; a tied output head scores a hidden vector
against every row of that same table. Every graph in this project is checked against these
functions, so they favour being obviously right: dot products use math.fsum, which is exact for
float32 inputs (each product of two float32 values is exact in a float64), rounded once.

Runs on a bare `python3 -I -S`. `python3 embed.py --help` shows the walkthrough.
"""
import argparse
import math
import operator
import os
import struct
import sys
from array import array
from itertools import repeat

_MASK = (1 << 64) - 1
_LANE = 128  # bits per counter in make_table's packed rows: a 64-bit value times a 64-bit constant fits
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (public: graphs.make_table repeats the generator)


def mix64(z):
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby counters."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def check_int(name, value, minimum=None):
    """`value` if it is an int (not a bool) >= `minimum`; else TypeError / ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def make_table(vocab_size, width, seed=0):
    """A deterministic `vocab_size x width` table of float32-exact, non-zero values in (-1, 1).

    Value (row, col) comes from a counter, not a stream: x = mix(seed) + ((row << 32) | col) * golden,
    z = mix64(x) (all mod 2**64), and the top 23 bits m of z give (2m + 1 - 2**23) / 2**23, an odd
    multiple of 2**-23: never zero and exact in float32. So a row never depends on vocab_size
    (doubling the vocabulary appends rows), and numpy reproduces it bit for bit (graphs.make_table).

    For speed a whole row is mixed at once: one Python int holds the row's `width` counters in 128-bit
    lanes, and each step of mix64 (xor-shift, multiply, mod 2**64) is done on every lane by one big-int
    operation, masked back to each lane's low 64 bits so no lane spills into the next. The arithmetic per
    value is exactly mix64's (tests compare every value with it); make_table(4096, 768) takes about 0.8 s.
    """
    check_int("vocab_size", vocab_size, 1)
    check_int("width", width, 1)
    check_int("seed", seed)
    key = mix64(seed & _MASK)
    lanes = sum(1 << (_LANE * col) for col in range(width))  # 1 in every lane
    low = _MASK * lanes  # each lane's low 64 bits
    top23 = ((1 << 23) - 1) * lanes
    steps = sum(((col * GOLDEN) & _MASK) << (_LANE * col) for col in range(width))  # (col * golden) mod 2**64
    nbytes = _LANE // 8 * width
    table = []
    for row in range(vocab_size):
        z = (((key + (row << 32) * GOLDEN) & _MASK) * lanes + steps) & low  # every counter of the row
        z = ((z ^ ((z >> 30) & low)) * 0xBF58476D1CE4E5B9) & low  # mix64, lane by lane
        z = ((z ^ ((z >> 27) & low)) * 0x94D049BB133111EB) & low
        z ^= (z >> 31) & low
        codes = array("Q", ((z >> 41) & top23).to_bytes(nbytes, "little"))  # (width, 2): lane low, high
        if sys.byteorder == "big":
            codes.byteswap()
        table.append([(m * 2 - 0x7FFFFF) / 0x800000 for m in codes[::2]])
    return table


def shape(table):
    """(vocab, width), after checking the table is a non-empty rectangle."""
    try:
        vocab = len(table)
        widths = {len(row) for row in table}
    except TypeError:
        raise TypeError(f"a table is a sequence of rows, got {type(table).__name__}") from None
    if vocab == 0:
        raise ValueError("the table is empty: it needs at least one row")
    if len(widths) != 1:
        raise ValueError(f"the table is ragged: row widths {sorted(widths)}")
    width = widths.pop()
    if width == 0:
        raise ValueError("the table's rows are empty: width must be >= 1")
    return vocab, width


def param_count(vocab_size, width, tied=True):
    """Values held by the input table and the output head: a tied head reuses the table and adds none."""
    check_int("vocab_size", vocab_size, 1)
    check_int("width", width, 1)
    return vocab_size * width * (1 if tied else 2)


# Precision: what the vocabulary costs in bytes. Formats in this order everywhere.
FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")
_VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
_QMAX = {"int8": 127, "int4": 7}
_F32 = struct.Struct("<f")


def _float32(x):
    """`x` rounded to the nearest float32 (ties to even), as a Python float."""
    return _F32.unpack(_F32.pack(x))[0]


def _rounded(values, code="f"):
    """`values` rounded to the nearest float32 ('f') or float16 ('e'), ties to even, as Python floats: one struct
    call for the whole row (OverflowError for a finite value past the format's range)."""
    layout = f"<{len(values)}{code}"
    return list(struct.unpack(layout, struct.pack(layout, *values)))


def _check_format(fmt, block_size):
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; want one of {', '.join(FORMATS)}")
    if block_size is not None:
        check_int("block_size", block_size, 1)


def _blocks(width, block_size):
    """[(start, stop)] of each block of a row: `block_size` columns (None: the whole row), the last maybe shorter."""
    size = width if block_size is None else block_size
    return [(start, min(start + size, width)) for start in range(0, width, size)]


def _to_float16(row):
    try:
        return _rounded(row, "e")  # IEEE binary16, nearest, ties to even
    except OverflowError:
        raise ValueError("a value is beyond float16's finite range (65504)") from None


def _to_bfloat16(row):
    layout = f"<{len(row)}I"
    bits = [(b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16  # the top 16 bits of the float32, nearest, ties to even
            for b in struct.unpack(layout, struct.pack(f"<{len(row)}f", *row))]
    if any(b & 0x7F800000 == 0x7F800000 for b in bits):
        raise ValueError("a value is beyond bfloat16's finite range")
    return list(struct.unpack(f"<{len(row)}f", struct.pack(layout, *bits)))


def quantize(table, fmt, block_size=None):
    """(codes, scales) of `table` stored in `fmt`, after rounding every value to float32.

    float16 / bfloat16: codes are the values rounded to the format (nearest, ties to even), scales None.
    int8 / int4: symmetric, one float32 scale per block of `block_size` columns of a row (None: the row),
    scale = float32(max|x| / qmax) (1.0 for an all-zero block), code = round-half-even(x / scale) clamped to
    [-qmax, qmax], qmax 127 / 7; codes are ints and scales a list of rows.
    """
    _check_format(fmt, block_size)
    shape(table)
    try:
        rows = [_rounded(row) for row in table]
    except OverflowError:
        raise ValueError("the table holds a value beyond float32's range") from None
    if not all(all(map(math.isfinite, row)) for row in rows):
        raise ValueError("the table holds NaN or inf")
    if fmt in ("float32", "float16", "bfloat16"):
        to = {"float32": list, "float16": _to_float16, "bfloat16": _to_bfloat16}[fmt]
        return [to(row) for row in rows], None
    qmax, blocks = _QMAX[fmt], _blocks(len(rows[0]), block_size)
    codes, scales = [], []
    for row in rows:
        row_scales = [_float32(max(map(abs, row[a:b])) / qmax) or 1.0 for a, b in blocks]
        row_codes = [round(x / scale) for (a, b), scale in zip(blocks, row_scales) for x in row[a:b]]
        if max(map(abs, row_codes)) > qmax:  # a scale rounded down can put x / scale a hair past qmax
            row_codes = [max(-qmax, min(qmax, code)) for code in row_codes]
        codes.append(row_codes)
        scales.append(row_scales)
    return codes, scales


def dequantize(codes, scales, fmt, block_size=None):
    """The table `quantize` stored: float formats, the codes; int8 / int4, float32(code x scale), rounded once
    (the product of a small int and a float32 is exact in a Python float)."""
    _check_format(fmt, block_size)
    shape(codes)
    if fmt in ("float32", "float16", "bfloat16"):
        return [[float(x) for x in row] for row in codes]
    blocks = _blocks(len(codes[0]), block_size)
    if scales is None or len(scales) != len(codes) or any(len(row) != len(blocks) for row in scales):
        raise ValueError(f"want {len(codes)} rows of {len(blocks)} scales for {fmt} blocks of {block_size}")
    return [_rounded([code * scale for (a, b), scale in zip(blocks, row_scales) for code in row[a:b]])
            for row, row_scales in zip(codes, scales)]


def table_bytes(vocab_size, width, fmt="float32", block_size=None, tied=True):
    """Bytes the table takes as stored in `fmt` (codes plus float32 scales; int4 packs two codes a byte), and
    as much again for an untied head."""
    check_int("vocab_size", vocab_size, 1)
    check_int("width", width, 1)
    _check_format(fmt, block_size)
    if fmt == "int4":
        stored = (vocab_size * width + 1) // 2
    else:
        stored = vocab_size * width * _VALUE_BYTES[fmt]
    if fmt in _QMAX:
        stored += 4 * vocab_size * len(_blocks(width, block_size))
    return stored * (1 if tied else 2)


def check_id(token_id, vocab_size, name="token id"):
    """`token_id` if it is an int in [0, vocab_size); else TypeError / IndexError naming the range."""
    if not isinstance(token_id, int) or isinstance(token_id, bool):
        raise TypeError(f"{name} must be an int, got {type(token_id).__name__} {token_id!r}")
    if not 0 <= token_id < vocab_size:  # unlike ONNX Gather, a negative id does not wrap
        raise IndexError(f"{name} {token_id} is out of range [0, {vocab_size})")
    return token_id


def check_ids(ids, vocab_size):
    """The ids as a list, each checked by check_id."""
    if isinstance(ids, (int, str, bytes)):
        raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__} {ids!r}")
    return [check_id(i, vocab_size) for i in ids]


def lookup(table, ids):
    """The rows for `ids`, in order, as new lists: the whole cost of a lookup is copying them."""
    vocab, _ = shape(table)
    return [list(map(float, table[i])) for i in check_ids(ids, vocab)]


def one_hot(token_id, vocab_size):
    """A list of `vocab_size` zeros with a single 1.0 at `token_id`."""
    check_int("vocab_size", vocab_size, 1)
    check_id(token_id, vocab_size)
    vector = [0.0] * vocab_size
    vector[token_id] = 1.0
    return vector


def onehot_lookup_counted(table, ids):
    """onehot_lookup's rows and the number of multiplications it really did (vocab * width per id)."""
    vocab, width = shape(table)
    rows, multiplications = [], 0
    for i in check_ids(ids, vocab):
        hot = one_hot(i, vocab)
        acc = [0.0] * width  # (width,)
        for r in range(vocab):  # every row, every product: 0.0 * x adds nothing, 1.0 * x is exact
            acc = list(map(operator.add, acc, map(operator.mul, repeat(hot[r]), table[r])))
            multiplications += width
        rows.append(acc)
    return rows, multiplications


def onehot_lookup(table, ids):
    """The rows for `ids` computed as one_hot(id) @ table: vocab*width products per id, same values as lookup."""
    return onehot_lookup_counted(table, ids)[0]


def dot(a, b):
    """Sum of products, rounded once (exact products of float32 values, fsum)."""
    if len(a) != len(b):
        raise ValueError(f"width mismatch: {len(a)} vs {len(b)}")
    return math.fsum(map(operator.mul, a, b))


def norm(v):
    """Euclidean length."""
    return math.sqrt(dot(v, v))


def cosine(a, b):
    """dot(a, b) / (|a| |b|): direction only. A zero vector has no direction, so it is an error."""
    na, nb = norm(a), norm(b)
    if na == 0.0 or nb == 0.0:
        raise ValueError("cosine of a zero vector: it has no direction")
    return dot(a, b) / (na * nb)


def logits(table, hidden):
    """One score per token: dot(table[t], hidden), which is what a tied output head computes."""
    vocab, width = shape(table)
    if len(hidden) != width:
        raise ValueError(f"width mismatch: hidden has {len(hidden)} values, the table's rows {width}")
    return [dot(row, hidden) for row in table]


def check_factor(factor):
    """`factor` if it is a finite real number > 0; else TypeError / ValueError."""
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise TypeError(f"factor must be a real number, got {type(factor).__name__} {factor!r}")
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"factor must be finite and > 0, got {factor}")
    return factor


def stretch_row(table, token_id, factor):
    """A new table with row `token_id` multiplied by `factor`: same direction, `factor` times the length."""
    vocab, _ = shape(table)
    check_id(token_id, vocab)
    check_factor(factor)
    return [[v * factor for v in row] if t == token_id else list(map(float, row))
            for t, row in enumerate(table)]


def _scores(table, token_id, metric):
    """The score of every token against `token_id` by `metric`."""
    vocab, _ = shape(table)
    check_id(token_id, vocab)
    query = table[token_id]
    if metric == "dot":
        return [dot(row, query) for row in table]
    if metric != "cosine":
        raise ValueError(f"unknown metric {metric!r}: use 'cosine' or 'dot'")
    norms = [norm(row) for row in table]
    zero = [t for t, n in enumerate(norms) if n == 0.0]
    if zero:
        raise ValueError(f"row {zero[0]} is all zeros: cosine needs a direction")
    return [dot(row, query) / (n * norms[token_id]) for row, n in zip(table, norms)]


def neighbors(table, token_id, k, metric="cosine"):
    """The `k` tokens closest to `token_id` by `metric`, itself excluded, best first, ties to the lower id."""
    check_int("k", k, 0)
    scores = _scores(table, token_id, metric)
    others = sorted((t for t in range(len(scores)) if t != token_id), key=lambda t: (-scores[t], t))
    return others[:k]


def scale_sqrt_d(table):
    """A new table with every value multiplied by sqrt(width): lengths grow sqrt(width) times, directions stay."""
    _, width = shape(table)
    scale = math.sqrt(width)
    return [[v * scale for v in row] for row in table]


def stretch_to_lead(table, query, token, beat_query=False):
    """The smallest power-of-two factor > 1 after which `token` leads `query`'s dot list, or None.

    With beat_query=True it must also beat the query's own score, |query|^2: what it takes to top
    the tied head's logits for hidden = the query's row. None when dot(query, token) <= 0:
    stretching a row that points away from the query only pushes it further down. Powers of two
    keep float32 values exact.
    """
    vocab, _ = shape(table)
    check_id(query, vocab, "query")
    check_id(token, vocab, "token")
    if token == query:
        raise ValueError(f"token {token} is the query itself; pick another token")
    score = dot(table[token], table[query])
    if score <= 0:
        return None
    rivals = [t for t in range(vocab) if t != token and (beat_query or t != query)]
    best = max((dot(table[t], table[query]) for t in rivals), default=0.0)
    factor = 2.0
    while factor * score <= best:  # strictly above the best other score: it leads whatever the ids
        factor *= 2.0
    return factor


def _walkthrough(vocab_size, width, seed, ids, query, k):
    """Print the lab's claims, measured on one table."""
    table = make_table(vocab_size, width, seed)
    vocab, width = shape(table)
    print(f"table = make_table({vocab}, {width}, seed={seed}): shape {shape(table)}")
    print(f"  values held: tied {param_count(vocab, width)}, untied {param_count(vocab, width, tied=False)}"
          " (an untied head is a second table)")
    print("  bytes held, tied / untied: " + ", ".join(
        f"{fmt} {table_bytes(vocab, width, fmt)} / {table_bytes(vocab, width, fmt, tied=False)}" for fmt in FORMATS)
        + " (int8 / int4 with one float32 scale a row)")
    doubled = make_table(2 * vocab, width, seed)
    print(f"  vocabulary doubled to {2 * vocab}: tied {param_count(2 * vocab, width)}, untied "
          f"{param_count(2 * vocab, width, tied=False)} (x{param_count(2 * vocab, width) / param_count(vocab, width):g});"
          f" the first {vocab} rows unchanged: {doubled[:vocab] == table}")

    rows = lookup(table, ids)
    hot_rows, multiplications = onehot_lookup_counted(table, ids)
    print(f"\nlookup {ids}: 0 multiplications; one-hot @ table: {multiplications} multiplications "
          f"({len(ids)} x {vocab} x {width})")
    print(f"  same values: {rows == hot_rows}")
    if len(set(ids)) < len(ids):  # an embedding has no context: the row is the same wherever the id stands
        same = all(rows[p] == rows[ids.index(i)] for p, i in enumerate(ids))
        print(f"  a repeated id gives the same vector at every position: {same}")

    print(f"\nneighbours of token {query} (k={k}):")
    by_cosine, by_dot = neighbors(table, query, k), neighbors(table, query, k, "dot")
    print(f"  cosine {by_cosine}\n  dot    {by_dot}")
    candidates = [t for t in neighbors(table, query, vocab, "dot")[1:] if dot(table[t], table[query]) > 0]
    if candidates:
        token = candidates[0]
        factor = stretch_to_lead(table, query, token)
        stretched = stretch_row(table, token, factor)
        after_cosine, after_dot = neighbors(stretched, query, k), neighbors(stretched, query, k, "dot")
        print(f"stretch token {token} (dot rank {neighbors(table, query, vocab, 'dot').index(token) + 1}) "
              f"by {factor:g}:")
        print(f"  cosine {after_cosine} (unchanged: {after_cosine == by_cosine})")
        print(f"  dot    {after_dot} (token {token} leads: {after_dot[:1] == [token]})")
    else:
        print("  no other token has a positive dot product with it, so stretching cannot bring one forward")

    scaled = scale_sqrt_d(table)
    row, row_scaled = table[query], scaled[query]
    print(f"\nscale by sqrt({width}) = {math.sqrt(width):.6f}, row {query}:")
    print(f"  norm {norm(row):.6f} -> {norm(row_scaled):.6f} (ratio {norm(row_scaled) / norm(row):.6f})")
    print(f"  cosine(row, scaled row) = {cosine(row, row_scaled):.9f}")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr and exit 2 (shared by the lab's commands)."""

    def error(self, message):  # one line, exit 2: no usage dump for a typo
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_ids(text):
    """'3,3,17' -> [3, 3, 17], for argparse (a one-line ArgumentTypeError otherwise)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"ids must be comma-separated integers, got {text!r}") from None


def run_cli(main, argv=None):
    """sys.exit(main(argv)) for a command of the lab, ending quietly (status 1, no traceback) when whoever reads
    its output stops reading, as `| head` does."""
    try:
        code = main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout again at exit
        code = 1
    sys.exit(code)


def main(argv=None):
    parser = OneLineParser(prog="embed.py", description="Walk through the embedding lab's claims on one table.")
    parser.add_argument("--vocab-size", type=int, default=16, help="rows in the table (default 16)")
    parser.add_argument("--width", type=int, default=8, help="values per row (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="table seed (default 0)")
    parser.add_argument("--ids", type=parse_ids, default=[3, 3, 7], help="ids to look up (default 3,3,7)")
    parser.add_argument("--query", type=int, default=0, help="token whose neighbours are listed (default 0)")
    parser.add_argument("--k", type=int, default=5, help="neighbours to list (default 5)")
    args = parser.parse_args(argv)
    try:
        check_int("vocab_size", args.vocab_size, 2)
        check_int("width", args.width, 1)
        check_int("k", args.k, 0)
        check_ids(args.ids + [args.query], args.vocab_size)
    except (TypeError, ValueError, IndexError) as e:
        parser.error(str(e))
    _walkthrough(args.vocab_size, args.width, args.seed, args.ids, args.query, args.k)
    return 0


if __name__ == "__main__":
    run_cli(main)
