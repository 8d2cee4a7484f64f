"""What a real table shows, measured and reported, never judged: row lengths, which rows lead whose dot lists (the
hubs, from the lab's neighbour graphs in onnxruntime), and how many tokens fail the seed's self-score claim (numpy's
float32 matmul, a block of tokens at a time against only the rows that could beat them)."""
import numpy as np

SELF_SCORE_MOST = 2 * 10**12  # V^2 d multiply-adds from which the self-score claim is checked on a sample
SELF_SCORE_SAMPLE = 6000  # the sample's tokens: the share that fails is known within 1.3% (95%), whatever V is
HUB_QUERIES = 2000  # sampled tokens whose top-k lists the hubs are counted in
SEED = 0  # the samples' generator: the same tokens every run
SCORES_AT_ONCE = 128 * 2**20  # bytes of scores one block of the self-scores makes (the hubs: half)


def norms(values, step=2**16):
    """Each row's Euclidean length, in float64 (a block of rows at a time)."""
    return np.concatenate([np.sqrt(np.einsum("ij,ij->i", b, b)) for b in
                           (values[i:i + step].astype(np.float64) for i in range(0, len(values), step))])


def mean_row(values, step=2**16):
    """The mean row, in float64."""
    return sum(values[i:i + step].astype(np.float64).sum(0) for i in range(0, len(values), step)) / len(values)


def self_score_tokens(vocab, width):
    """(the tokens the self-score claim is checked on, sampled): every token when V^2 d <= SELF_SCORE_MOST, else
    SELF_SCORE_SAMPLE of them (a proportion's precision depends on the sample's size, not the vocabulary's), drawn
    without replacement by a fixed seed, in id order."""
    if vocab * vocab * width <= SELF_SCORE_MOST or vocab <= SELF_SCORE_SAMPLE:
        return np.arange(vocab), False
    return np.sort(np.random.default_rng(SEED).choice(vocab, SELF_SCORE_SAMPLE, replace=False)), True


def _firsts(ranked, order, norms, tokens, hidden_of):
    """(first, led_by) for each of `tokens`: whether the token scores first when hidden_of(block of tokens) is fed
    to a tied head over the table whose rows, longest first, are `ranked` (`order` their ids, `norms` every row's
    length), ties to the lower id, and the token that scores first.

    Only rows at least as long as a token's hidden vector can beat it: r_t.r_j <= |r_t||r_j| < |r_t|^2 when
    |r_j| < |r_t| (Cauchy-Schwarz). So a block of tokens is scored against the prefix of rows as long as its
    shortest: about half the products of the whole V x V matmul, exactly the same answer up to float32's rounding
    of scores within a few units of each other."""
    position = np.empty(len(order), np.int64)
    position[order] = np.arange(len(order))
    tokens = tokens[np.argsort(position[tokens], kind="stable")]  # longest first too: each block a short prefix
    first, led_by = np.empty(len(tokens), bool), np.empty(len(tokens), np.int64)
    step, sorted_norms = max(1, SCORES_AT_ONCE // (4 * len(order))), -norms[order]
    for i in range(0, len(tokens), step):
        block = tokens[i:i + step]
        reach = int(np.searchsorted(sorted_norms, -norms[block].min(), side="right"))  # rows >= its shortest
        scores = hidden_of(block) @ ranked[:reach].T  # (n, reach)
        rows, own_column = np.arange(len(block)), position[block]
        own = scores[rows, own_column].copy()
        scores[rows, own_column] = -np.inf  # the best of the others, in one pass
        best = scores.argmax(axis=1)
        other = scores[rows, best]
        won = own > other
        for r in np.flatnonzero(own == other):  # an equal score (rare): the lower id comes first
            won[r] = block[r] < order[:reach][scores[r] == own[r]].min()
        first[i:i + step], led_by[i:i + step] = won, np.where(won, block, order[best])
    back = np.argsort(tokens, kind="stable")
    return first[back], led_by[back]


def _ranked(values, shift=None, step=2**16):
    """(the rows, less `shift` (float32) when given, longest first; their ids; every such row's length): one copy
    of the table, made a block of rows at a time."""
    shifted = (lambda rows: rows) if shift is None else (lambda rows: rows - shift)
    lengths = np.concatenate([np.sqrt(np.einsum("ij,ij->i", b, b)) for b in (
        shifted(values[i:i + step]).astype(np.float64) for i in range(0, len(values), step))])
    order = np.argsort(-lengths, kind="stable")
    ranked = np.empty(values.shape, np.float32)
    for i in range(0, len(order), step):
        ranked[i:i + step] = shifted(values[order[i:i + step]])
    return ranked, order, lengths


def self_score(values, progress=None):
    """{checked, not_first, not_first_centered, sampled, tokens, top, mean_norm}: fed a token's own row as the
    hidden vector, does the tied head score that token first (`top` the token that does)? And with the table's
    mean row taken off every row. Computed with numpy's float32 matmul (a figure, not a check of the graphs), one
    ranked copy of the table at a time."""
    tokens, sampled = self_score_tokens(*values.shape)
    mean = mean_row(values)
    if progress:
        progress(f"self-scores of {len(tokens)} tokens against the rows as long as each")
    ranked, order, lengths = _ranked(values)
    first, top = _firsts(ranked, order, lengths, tokens, lambda b: values[b])
    del ranked
    if progress:
        progress(f"self-scores of {len(tokens)} tokens, the mean row taken off")
    shift = mean.astype(np.float32)
    ranked, order, lengths = _ranked(values, shift)
    first_centered, _ = _firsts(ranked, order, lengths, tokens, lambda b: values[b] - shift)
    del ranked
    return {"checked": len(tokens), "not_first": int(np.count_nonzero(~first)),
            "not_first_centered": int(np.count_nonzero(~first_centered)), "sampled": sampled, "tokens": tokens,
            "top": np.where(first, tokens, top), "mean_norm": float(np.sqrt(mean @ mean))}


def hub_sample(vocab, most=HUB_QUERIES):
    """The tokens the hubs are counted over: `most` drawn without replacement by a fixed seed (every token if
    fewer), in id order."""
    return np.sort(np.random.default_rng(SEED).choice(vocab, min(most, vocab), replace=False))


def hubs(lab, k):
    """{queries, k, dot, cosine}: over hub_sample's tokens, how often each row appears in their top-k lists by dot
    and by cosine (the lab's neighbour graphs, one session at a time, its arena kept for the blocks of one shape),
    as count arrays. The table's all-zero rows (lab.zero_rows) are neither sampled nor counted in a cosine list
    (their cosine is 0/0: k + their count asked for, those dropped, the first k others kept)."""
    vocab, skipped = lab.values.shape[0], np.asarray(sorted(lab.zero_rows), np.int64)
    # the cosine graph scales every row on each run: the larger the block, the fewer runs (and the higher the peak)
    sample, block = np.setdiff1d(hub_sample(vocab), skipped), max(1, SCORES_AT_ONCE // 2 // (4 * vocab))
    counts = {}
    for metric in ("dot", "cosine"):
        runner, seen = lab.runner(f"neighbors_{metric}", arena=True), np.zeros(vocab, np.int64)
        extra = len(skipped) if metric == "cosine" else 0
        for i in range(0, len(sample), block):
            found = runner.run({"ids": sample[i:i + block], "k": [k + extra]})["indices"]
            if extra:
                found = np.stack([row[~np.isin(row, skipped)][:k] for row in found])
            np.add.at(seen, found.reshape(-1), 1)
        lab.close(f"neighbors_{metric}")
        counts[metric] = seen
    return {"queries": len(sample), "k": k, **counts}
