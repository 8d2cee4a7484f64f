"""Neighbors by cosine and by dot, and the stretch claim: length moves the dot list, never the cosine list."""
import graphs
from runtime.compare.bounds import Check, cosine_bound, differing_positions, dot_bound, within


def score_bounds(reference, metric, tokens, factor=None):
    """({token: reference score against the query}, {token: float32 bound of the graph's score}) for `tokens` of
    reference.at(factor): scores by embed.dot / embed.cosine, one token at a time (only those a list comparison
    needs)."""
    impl, table = reference.embed, reference.at(factor)
    query = table[reference.config.query]
    if metric == "dot":
        bound = dot_bound(reference, query, factor)
        return {t: impl.dot(table[t], query) for t in tokens}, {t: bound[t] for t in tokens}
    scores = {t: impl.cosine(table[t], query) for t in tokens}
    return scores, cosine_bound(reference, query, scores, factor)


def _graph_neighbors(config, reference, sessions, metric, factor=None):
    """The graph's neighbor list of the query: the exported graph's, or one built on reference.at32(factor)."""
    runner = sessions.runner(f"neighbors_{metric}") if factor is None else sessions.runner(
        f"neighbors_{metric}_x{factor:g}", graphs.neighbors(reference.at32(factor), metric))
    out = runner.run({"ids": [config.query], "k": [config.k]})
    return [int(i) for i in out["indices"][0]], out["scores"][0]


def check_neighbors(config, reference, sessions):
    checks = []
    for metric in ("cosine", "dot"):
        got, got_scores = _graph_neighbors(config, reference, sessions, metric)
        want = reference.neighbors(metric, config.k)
        scores, bounds = score_bounds(reference, metric, set(got) | set(want))
        ok_scores, diff, worst = within(got_scores, [scores[t] for t in got], [bounds[t] for t in got])
        ok = ok_scores and config.query not in got and differing_positions(got, want, scores, bounds) == 0
        shown = lambda ids: f"{ids[:8]}{'...' if len(ids) > 8 else ''}"
        checks.append(Check("neighbors", f"neighbors_{metric}", ok,
                            f"{config.listed()} of token {config.query} by {metric}: graph {shown(got)} vs "
                            f"embed.neighbors {shown(want)}; scores worst diff/bound {worst:.2f}",
                            diff, float(max(bounds.values())), {"indices": got, "reference": want},
                            claim=f"{config.listed()} of token {config.query} by {metric} == embed.neighbors; scores "
                                  "within bound"))
    checks.append(check_stretch(config, reference, sessions))
    return checks


def check_stretch(config, reference, sessions):
    q, s, factor = config.query, reference.stretch, reference.factor
    graph = "neighbors_*"
    before_dot = reference.neighbors("dot")
    score = reference.embed.dot(reference.table[s], reference.table[q])
    if score <= 0:
        return Check("stretch", graph, None, f"token {s} points away from token {q} (dot {score:.3g} <= 0): "
                     "stretching it only pushes it down the dot list, so the claim does not apply; pick another --stretch",
                     claim=f"token {s} points away from token {q}: the stretch claim does not apply")
    if before_dot[0] == s:
        return Check("stretch", graph, None, f"token {s} already leads token {q}'s dot list before stretching: "
                     "nothing to show; pick another --stretch",
                     claim=f"token {s} already leads token {q}'s dot list: nothing to show")
    if reference.neighbors("dot", 1, factor) != [s]:
        return Check("stretch", graph, None, f"x{factor:g} is not enough for token {s} to lead token {q}'s dot list "
                     f"(x{reference.lead(beat_query=False):g} is); the claim does not apply",
                     claim=f"x{factor:g} is not enough for token {s} to lead token {q}'s dot list: does not apply")
    before_cos, _ = _graph_neighbors(config, reference, sessions, "cosine")
    after_cos, _ = _graph_neighbors(config, reference, sessions, "cosine", factor)
    after_dot, _ = _graph_neighbors(config, reference, sessions, "dot", factor)
    scores, bounds = score_bounds(reference, "cosine", set(after_cos) | set(before_cos), factor)
    moved = differing_positions(after_cos, before_cos, scores, bounds)
    reference_same = reference.neighbors("cosine", config.k, factor) == reference.neighbors("cosine", config.k)
    ok = moved == 0 and after_dot[:1] == [s] and reference_same
    return Check("stretch", graph, ok,
                 f"row {s} x{factor:g}: cosine list of {q} unchanged: {moved == 0} ({moved} positions differ beyond "
                 f"their scores' bounds; embed.neighbors unchanged too: {reference_same}); dot list now led by "
                 f"{after_dot[:1]} (was rank {before_dot.index(s) + 1})", float(moved + (not reference_same)), 0.0,
                 {"token": s, "factor": factor, "dot_after": after_dot, "cosine_after": after_cos},
                 claim=f"row {s} x{factor:g}: token {q}'s cosine list unchanged, its dot list led by {s}")
