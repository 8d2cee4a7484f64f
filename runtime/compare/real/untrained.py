"""Tokens a tied model never trained, found from its table alone: the indicator of Land & Bartolo, "Fishing for
Magikarp" (2024). Rows that training never reached keep what initialisation and weight decay left them, and so
point the same way as the rows of tokens the vocabulary reserves and no text contains: each row's cosine to the
mean of those reference rows, after the direction every row shares (the table's first principal component) is
taken out, ranks them. Two passes over the table: its Gram matrix, then each row's projections."""
import re

import numpy as np

from runtime.compare.bounds import Check

REFERENCE = re.compile(r"<unused\d+>|\[unused\d+\]|<\|reserved_special_token_\d+\|>")  # Gemma, BERT, Llama 3
PERCENTILE = 5  # a candidate's indicator reaches this percentile of the reference rows' own
SHOWN = 20  # candidates --json lists, best first
MARKED = "tokens the vocabulary marks unused or reserved (<unusedN>, [unusedN], <|reserved_special_token_N|>)"
NEVER_MADE = ("tokens the tokenizer never makes of their own strings (its model on the token's string: merges, "
              "best split or longest match give other tokens; added, special and byte pieces left out)")
ROWS_AT_ONCE = 65536  # rows projected at a time: 160 MiB of float32 at width 640


def reference_ids(vocabulary):
    """(ids, how): the tokens the vocabulary marks unused or reserved, by their strings; else, where there are
    not two, the tokens its tokenizer never makes of their own strings (Vocabulary.never_made); how says which."""
    strings = vocabulary.strings or []
    marked = [i for i, token in enumerate(strings) if token is not None and REFERENCE.fullmatch(token)]
    if len(marked) >= 2:
        return marked, MARKED
    return (vocabulary.never_made() or []), NEVER_MADE


def first_component(values):
    """The table's first principal component (unit, float64 [width]) and its mean row, from one pass: the Gram
    matrix of the rows, a chunk at a time, less the mean's outer product."""
    width = values.shape[1]
    gram, total = np.zeros((width, width)), np.zeros(width)
    for t0 in range(0, len(values), ROWS_AT_ONCE):
        rows = np.asarray(values[t0:t0 + ROWS_AT_ONCE], np.float64)
        gram += rows.T @ rows
        total += rows.sum(axis=0)
    mean = total / len(values)
    _, vectors = np.linalg.eigh(gram / len(values) - np.outer(mean, mean))
    return vectors[:, -1], mean


def indicator(values, vocabulary, tied, shown=SHOWN):
    """--json's `table.under_trained`: {"reference": {"how", "count"}, "indicator", "threshold", "candidates":
    [{"id", "token", "score", "norm"}] (the first `shown`, best first), "count", "verified": None}, or None where
    the table is not the unembedding (an untied model's head is another table) or fewer than two reference tokens
    (nothing to compare with)."""
    if not tied:
        return None
    reference, how = reference_ids(vocabulary)
    if len(reference) < 2:
        return None
    component, mean = first_component(values)
    target = np.asarray(values[reference], np.float64) - mean
    target = (target - np.outer(target @ component, component)).mean(axis=0)  # the reference's mean, component out
    scores, norms = np.empty(len(values)), np.empty(len(values))
    for t0 in range(0, len(values), ROWS_AT_ONCE):
        rows = np.asarray(values[t0:t0 + ROWS_AT_ONCE], np.float64)
        norms[t0:t0 + len(rows)] = np.linalg.norm(rows, axis=1)
        rows -= mean
        along = rows @ component
        rest = np.sqrt(np.maximum(np.einsum("ij,ij->i", rows, rows) - along ** 2, 0.0))
        scores[t0:t0 + len(rows)] = (rows @ target - along * (component @ target)) / np.maximum(
            rest * np.linalg.norm(target), np.finfo(np.float64).tiny)
    threshold = float(np.percentile(scores[reference], PERCENTILE))
    marked = np.zeros(len(values), bool)
    marked[reference] = True
    passing = np.flatnonzero((scores >= threshold) & ~marked)
    best = passing[np.argsort(-scores[passing], kind="stable")][:shown]
    return {"reference": {"how": how, "count": len(reference)},
            "indicator": "cosine to the reference rows' mean, the table's first principal component removed "
                         "(Land & Bartolo 2024)",
            "threshold": round(threshold, 6), "count": int(len(passing)),
            "candidates": [{"id": int(t), "token": vocabulary.token(int(t)), "score": round(float(scores[t]), 6),
                            "norm": round(float(norms[t]), 6)} for t in best],
            "verified": None}


def check(found, tied):
    """The INFO Check of indicator()'s answer `found`, or of why none was computed."""
    if found is None:
        said = ("under-trained: not looked for: the model is not tied, and the indicator reads the head's rows, "
                "another table" if not tied else
                "under-trained: not looked for: the vocabulary marks no token unused or reserved, and its "
                "tokenizer makes every token of its own string (or there is none): the indicator needs a reference")
    else:
        said = _line(found)
    return Check("under_trained", "token table", None, said, info=True, claim=said)


def _line(found):
    first = ", ".join(c["token"] or f"#{c['id']}" for c in found["candidates"][:5]) or "none"
    reference = "unused" if found["reference"]["how"] == MARKED else "never-made"
    return (f"under-trained: {found['count']} tokens reach {found['threshold']:.3f}, the {PERCENTILE}th percentile "
            f"of {found['reference']['count']} {reference} tokens' own indicator (cosine to their mean, first "
            f"principal component out); first: {first}")
