"""Neighbours by cosine and by dot, and the stretch claim: length moves the dot list, never the cosine list."""
import embed
import graphs
from runtime.compare.bounds import Check, gamma, within


def score_bounds(lab, table, metric, tokens):
    """({token: reference score against the query}, {token: float32 bound of the graph's score}) for `tokens`:
    scores by embed.dot / embed.cosine, one token at a time (only the tokens a list comparison needs)."""
    query = table[lab.query]
    if metric == "dot":
        bound = lab.dot_bound(table, query)
        return {t: embed.dot(table[t], query) for t in tokens}, {t: bound[t] for t in tokens}
    scores = {t: embed.cosine(table[t], query) for t in tokens}
    return scores, lab.cosine_bound(table, query, scores)


def _same_lists(got, want, scores, bounds):
    """Exact, except where the reference scores of the two tokens are within their bounds of each other."""
    if len(got) != len(want):
        return False
    return all(g == w or abs(scores[g] - scores[w]) <= bounds[g] + bounds[w] for g, w in zip(got, want))


def _graph_neighbors(lab, table, metric, exported=False):
    """The graph's neighbour list of the query: the exported graph's session, or a new graph for `table`."""
    runner = lab.runner(f"neighbors_{metric}") if exported else lab.runner(
        f"neighbors_{metric}_x{lab.factor:g}", graphs.neighbors(lab.stretched32(table), metric))
    out = runner.run({"ids": [lab.query], "k": [lab.k]})
    return [int(i) for i in out["indices"][0]], out["scores"][0]


def check_neighbors(lab):
    checks = []
    for metric in ("cosine", "dot"):
        got, got_scores = _graph_neighbors(lab, lab.table, metric, exported=True)
        lab.progress(f"embed.neighbors by {metric} over {lab.vocab} tokens")
        want = lab.neighbors(lab.table, metric, lab.k)
        scores, bounds = score_bounds(lab, lab.table, metric, set(got) | set(want))
        ok_scores, diff, worst = within(got_scores, [scores[t] for t in got], [bounds[t] for t in got])
        ok = ok_scores and lab.query not in got and _same_lists(got, want, scores, bounds)
        checks.append(Check("neighbors", f"neighbors_{metric}", ok,
                            f"top {lab.k} of token {lab.query} by {metric}: graph {got[:8]}{'...' if len(got) > 8 else ''}"
                            f" vs embed.neighbors {want[:8]}{'...' if len(want) > 8 else ''}; scores worst diff/bound "
                            f"{worst:.2f}", diff, float(max(bounds.values())), {"indices": got, "reference": want}))
    checks.append(check_stretch(lab))
    return checks


def check_stretch(lab):
    q, s, factor = lab.query, lab.stretch, lab.factor
    graph = "neighbors_*"
    before_dot = lab.neighbors(lab.table, "dot")
    score = embed.dot(lab.table[s], lab.table[q])
    if score <= 0:
        return Check("stretch", graph, None, f"token {s} points away from token {q} (dot {score:.3g} <= 0): "
                     "stretching it only pushes it down the dot list, so the claim does not apply; pick another --stretch")
    if before_dot[0] == s:
        return Check("stretch", graph, None, f"token {s} already leads token {q}'s dot list before stretching: "
                     "nothing to show; pick another --stretch")
    lab.progress(f"embed.stretch_row({s}, x{factor:g}) and its neighbours")
    stretched = lab.stretched(factor)
    if lab.neighbors(stretched, "dot", 1) != [s]:
        return Check("stretch", graph, None, f"x{factor:g} is not enough for token {s} to lead token {q}'s dot list "
                     f"(x{embed.stretch_to_lead(lab.table, q, s):g} is); the claim does not apply")
    before_cos, _ = _graph_neighbors(lab, lab.table, "cosine", exported=True)
    after_cos, _ = _graph_neighbors(lab, stretched, "cosine")
    after_dot, _ = _graph_neighbors(lab, stretched, "dot")
    scores, bounds = score_bounds(lab, stretched, "cosine", set(after_cos) | set(before_cos))
    cos_same = _same_lists(after_cos, before_cos, scores, bounds)
    reference_same = lab.neighbors(stretched, "cosine", lab.k) == lab.neighbors(lab.table, "cosine", lab.k)
    ok = cos_same and after_dot[:1] == [s] and reference_same
    return Check("stretch", graph, ok,
                 f"row {s} x{factor:g}: cosine list of {q} unchanged: {cos_same}; dot list now led by {after_dot[:1]} "
                 f"(was rank {before_dot.index(s) + 1})", None, None,
                 {"token": s, "factor": factor, "dot_after": after_dot, "cosine_after": after_cos})
