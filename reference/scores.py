"""Lookups into the table and scores out of it: rows by id, one-hot products, dot and cosine, logits,
neighbours, and what stretching or scaling a row does to them."""
import heapq
import math
import operator
from itertools import repeat

from reference.tables import check_int, shape

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


def ranked(scores, token_id, k):
    """The `k` tokens of best `scores` (one per token) other than `token_id`, best first, ties to the lower id; a
    score of None (a cosine an all-zero row has not) is left out."""
    check_int("k", k, 0)
    others = (t for t in range(len(scores)) if t != token_id and scores[t] is not None)
    return heapq.nsmallest(k, others, key=lambda t: (-scores[t], t))  # == sorted(...)[:k], in O(V log k)


def neighbors(table, token_id, k, metric="cosine"):
    """The `k` tokens closest to `token_id` by `metric`, itself excluded, best first, ties to the lower id."""
    check_int("k", k, 0)
    return ranked(_scores(table, token_id, metric), token_id, k)


def scores_of(table, token_ids, zero_rows=False):
    """{token_id: {"dot": [...], "cosine": [...]}}: every token's score against each of `token_ids` by both
    metrics, the numbers neighbors ranks, from one pass over the table: each row read once, its norm and its dot
    with each query taken once. ranked(scores_of(...)[q][m], q, k) == neighbors(table, q, k, m), and the dot
    scores == logits(table, table[q]), for a caller that needs several (a real table's rows are costly to read).
    An all-zero row has no direction: ValueError, or with `zero_rows` its cosine None (ranked leaves it out; a
    query must have a direction)."""
    vocab, _ = shape(table)
    queries = {q: table[check_id(q, vocab)] for q in token_ids}
    dots, norms = {q: [] for q in queries}, []
    for t, row in enumerate(table):
        norms.append(norm(row))
        if norms[-1] == 0.0 and (not zero_rows or t in queries):
            raise ValueError(f"row {t} is all zeros: cosine needs a direction")
        for q, query in queries.items():
            dots[q].append(dot(row, query))
    return {q: {"dot": dots[q], "cosine": [None if n == 0.0 else d / (n * norms[q]) for d, n in zip(dots[q], norms)]}
            for q in queries}


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
    return lead_factor([dot(row, table[query]) for row in table], query, token, beat_query)


def lead_factor(scores, query, token, beat_query=False):
    """stretch_to_lead's rule on `scores`, each token's dot product with the query's row (embed.logits(table,
    table[query])), for a caller that has them already."""
    score = scores[token]
    if not score > 0 or score == math.inf:  # NaN, zero, negative or infinite: no factor makes it lead
        return None
    best = max((v for t, v in enumerate(scores) if t != token and (beat_query or t != query)), default=0.0)
    if best != best or best == math.inf:  # a NaN or an infinite score elsewhere: nothing finite beats it
        return None
    factor = 2.0
    while factor * score <= best:  # strictly above the best other score: it leads whatever the ids
        factor *= 2.0
    return factor
