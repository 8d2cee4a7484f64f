"""What a person reads first: each query's cosine and dot lists side by side, then the checks, then the figures in
sentences; and --json's `table`."""
import numpy as np

import embed
from runtime.compare.bounds import Check
from runtime.model.read.text import field

TOKEN_WIDTH = 20  # characters of a token shown in a list column


def _cell(text, width=TOKEN_WIDTH):
    return text if len(text) <= width else text[:width - 1] + "…"


def side_by_side(vocabulary, lengths, query, cosine, dot):
    """The query's two lists as one table: rank, token and cosine; token, dot product and that row's length (the
    long rows that lead a dot list stand out beside the cosine list)."""
    lines = [f"{vocabulary.shown(query)} (id {query}, length {lengths[query]:.2f}): its {len(cosine[0])} nearest "
             "other tokens",
             f"  {'#':>2}  {'by cosine':<{TOKEN_WIDTH}} {'cosine':>7}   | {'by dot product':<{TOKEN_WIDTH}} "
             f"{'dot':>8} {'length':>7}"]
    for rank, (c, cs, d, ds) in enumerate(zip(cosine[0], cosine[1], dot[0], dot[1]), 1):
        lines.append(f"  {rank:>2}  {_cell(vocabulary.shown(c)):<{TOKEN_WIDTH}} {cs:>7.3f}   | "
                     f"{_cell(vocabulary.shown(d)):<{TOKEN_WIDTH}} {ds:>8.2f} {lengths[d]:>7.2f}")
    return "\n".join(lines)


def _share(count, total):
    return f"{count} of {total} tokens ({100 * count / total:.1f}%)"


def self_score_line(vocabulary, lengths, found):
    """The seed's self-score claim against this table, in one sentence (an INFO Check)."""
    checked, sample = found["checked"], " sampled" if found["sampled"] else ""
    leaders = {}
    for t, top in zip(found["tokens"], found["top"]):
        if t != top:
            leaders[int(top)] = leaders.get(int(top), 0) + 1
    lead = max(leaders.items(), key=lambda kv: (kv[1], -kv[0]), default=None)
    led = f"; {vocabulary.shown(lead[0])} (length {lengths[lead[0]]:.2f}) leads {lead[1]} of them" if lead else ""
    claim = (f"the seed says a token's own row, as the hidden vector, scores that token first; on this table it does "
             f"not for {_share(found['not_first'], checked)}{sample}{led}; with the mean row (length "
             f"{found['mean_norm']:.2f}) taken off every row, for {_share(found['not_first_centered'], checked)}")
    return Check("self_score", "tied_logits", None, claim, info=True, claim=claim,
                 values={k: found[k] for k in ("checked", "not_first", "not_first_centered", "sampled")})


def hubs_line(vocabulary, counts):
    """The rows found most often in sampled tokens' dot lists, against the cosine lists (an INFO Check)."""
    dot, cosine, n, k = counts["dot"], counts["cosine"], counts["queries"], counts["k"]
    top_dot, top_cos = int(dot.argmax()), int(cosine.argmax())
    claim = (f"in the top-{k} lists of {n} sampled tokens: {vocabulary.shown(top_dot)} is in {dot[top_dot]} dot lists "
             f"({cosine[top_dot]} cosine lists); the cosine lists' most frequent row, {vocabulary.shown(top_cos)}, is "
             f"in {cosine[top_cos]}")
    return Check("hubs", "neighbors_*", None, claim, info=True, claim=claim)


def table_lines(table, lengths, vocabulary, longest):
    """INFO Checks: the table's size and tie, what doubling the vocabulary costs, its row lengths, its row scale, and
    its all-zero rows where it has any."""
    vocab, width = table.shape
    doubled = doubled_bytes(table)
    tie = f"tied (the head reads {table.head})" if table.tied else "not tied: the head is another table" \
        if table.scored else "no head scores tokens (an encoder or feature extractor)"
    if table.others:  # the model's other token tables (position, token type), named, not chosen
        tie += f"; other token tables, not the vocabulary's rows: {', '.join(table.others)}"
    lines = [(f"{vocab} x {width} = {embed.param_count(vocab, width)} values, {table.bytes} bytes as stored "
              f"({table.format}); {tie}"),
             (f"doubling the vocabulary: {doubled['tied_bytes']} bytes tied, {doubled['untied_bytes']} untied (values "
              f"{embed.param_count(2 * vocab, width)} / {embed.param_count(2 * vocab, width, tied=False)})"),
             (f"row lengths {lengths.min():.2f} ({vocabulary.shown(int(lengths.argmin()))}) to {lengths.max():.2f} "
              f"({vocabulary.shown(int(lengths.argmax()))}), median {float(np.median(lengths)):.2f}; "
              "longest: " + ", ".join(f"{vocabulary.shown(t)} {lengths[t]:.2f}" for t in longest)),
             row_scale_words(table)]
    names = ["table", "sizes", "lengths", "row_scale"]
    if table.zero_rows:
        zero = table.zero_rows
        lines.append(f"{len(zero)} all-zero row{'s' if len(zero) != 1 else ''} (padding rows: "
                     f"{', '.join(vocabulary.shown(t) for t in zero[:5])}{', ...' if len(zero) > 5 else ''}): no "
                     "direction, so no cosine; left out of every cosine list and of the hubs' sample")
        names.append("zero_rows")
    return [Check(name, table.name if len(table.name) <= 22 else "token table", None, line, info=True, claim=line)
            for name, line in zip(names, lines)]


def row_scale_words(table):
    if table.row_scale is None:
        if table.architecture is not None:  # a GGUF file: the scale lives in llama.cpp's code, by architecture
            return f"llama.cpp reads architecture {field(table.architecture, 40)}'s looked-up rows as stored (no scale)"
        if table.tokens is not None:
            return "a GGUF file without general.architecture does not say whether its model scales looked-up rows"
        return "the model does not scale its looked-up rows (no constant multiplies them)"
    root = "= sqrt(width)" if table.row_scale_is_sqrt_width else "not sqrt(width)"
    by = f"llama.cpp multiplies architecture {field(table.architecture, 40)}'s" if table.architecture else \
        "the model multiplies"
    return f"{by} looked-up rows by {table.row_scale:.6g} ({root} = {table.width ** 0.5:.6g})"


def doubled_bytes(table):
    """{tied_bytes, untied_bytes} of this table's format at twice its vocabulary: embed.table_bytes where the format is
    one of embed's float formats, else its bytes a row doubled."""
    vocab, width = table.shape
    if table.format in ("float32", "float16", "bfloat16"):
        return {"tied_bytes": embed.table_bytes(2 * vocab, width, table.format),
                "untied_bytes": embed.table_bytes(2 * vocab, width, table.format, tied=False)}
    return {"tied_bytes": 2 * table.bytes, "untied_bytes": 4 * table.bytes}


def _token(vocabulary, t, **more):
    return {"id": int(t), "token": vocabulary.token(int(t)), **more}


EXAMPLES = 5  # self-score examples and hub rows --json lists


def table_json(table, vocabulary, lengths, longest, lists, found, counts):
    """--json's `table` (SPEC, 'The lab on a real model')."""
    most = EXAMPLES
    vocab, width = table.shape
    examples = [_token(vocabulary, t, norm=float(lengths[t]), led_by=_token(vocabulary, top, norm=float(lengths[top])))
                for t, top in zip(found["tokens"], found["top"]) if t != top][:most]
    order = sorted(range(len(counts["dot"])), key=lambda t: (-counts["dot"][t], t))[:most]
    return {"model": table.model, "name": table.name, "vocab_size": vocab, "width": width, "format": table.format,
            "values": embed.param_count(vocab, width), "bytes": table.bytes, "tied": table.tied, "head": table.head,
            "row_scale": table.row_scale, "doubled_vocab": doubled_bytes(table),
            "norms": {"min": float(lengths.min()), "max": float(lengths.max()),
                      "median": float(np.median(lengths))},
            "longest": [_token(vocabulary, t, norm=float(lengths[t])) for t in longest],
            "queries": [_token(vocabulary, q, **{metric: [_token(vocabulary, t, score=float(s)) for t, s in zip(*pair)]
                                                 for metric, pair in both.items()}) for q, both in lists.items()],
            "self_score": {**{k: found[k] for k in ("checked", "not_first", "not_first_centered", "sampled")},
                           "examples": examples},
            "hubs": {"queries": counts["queries"], "k": counts["k"],
                     "rows": [_token(vocabulary, t, in_dot_lists=int(counts["dot"][t]),
                                     in_cosine_lists=int(counts["cosine"][t])) for t in order]}}
