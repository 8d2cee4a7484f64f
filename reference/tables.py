"""Tables: a deterministic vocab x width table of float32-exact values, its shape and the values it holds."""
import operator
import sys
from array import array

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
    value is exactly mix64's (tests compare every value with it). The values come out the same way: each
    lane becomes the bits of the double 3 + v (exponent of 2.0, mantissa (2m + 1) * 2**28, exact because
    3 + v lies in [2, 4)), the row's bytes are read as doubles, and 3.0 is taken off each, exactly (both lie
    in [2, 4)); make_table(4096, 768) takes about 0.7 s.
    """
    check_int("vocab_size", vocab_size, 1)
    check_int("width", width, 1)
    check_int("seed", seed)
    key = mix64(seed & _MASK)
    lanes = sum(1 << (_LANE * col) for col in range(width))  # 1 in every lane
    low = _MASK * lanes  # each lane's low 64 bits
    top23 = ((1 << 23) - 1) * lanes
    steps = sum(((col * GOLDEN) & _MASK) << (_LANE * col) for col in range(width))  # (col * golden) mod 2**64
    three = ((1024 << 52) | (1 << 28)) * lanes  # 2.0's exponent and the mantissa's + 1, in every lane
    nbytes = _LANE // 8 * width
    offsets = [3.0] * width
    table = []
    for row in range(vocab_size):
        z = (((key + (row << 32) * GOLDEN) & _MASK) * lanes + steps) & low  # every counter of the row
        z = ((z ^ ((z >> 30) & low)) * 0xBF58476D1CE4E5B9) & low  # mix64, lane by lane
        z = ((z ^ ((z >> 27) & low)) * 0x94D049BB133111EB) & low
        z ^= (z >> 31) & low
        doubles = array("d", ((((z >> 41) & top23) << 29) + three).to_bytes(nbytes, "little"))  # lane: low, high
        if sys.byteorder == "big":
            doubles.byteswap()
        table.append(list(map(operator.sub, doubles[::2], offsets)))  # 3 + v - 3 = v, exactly
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
