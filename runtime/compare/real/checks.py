"""The lab's claims on a real table, each a PASS or FAIL against embed.py as for a generated table: the lookup,
one-hot == lookup bit for bit, neighbours by cosine and by dot, a stretched row, sqrt(width) scaling. Only the
rows and scores a claim needs go through the pure-Python reference; each neighbour list is ranked by it in full."""
import math

import numpy as np

import embed
from runtime.bounds import U64, as64, gamma
from runtime.compare.bounds import Check, differing_bits, differing_positions, scaled_tolerances, within
from runtime.compare.lookups import ONEHOT_CLAIM


def check_lookup(lab, rows, ids):
    out = lab.runner("gather_lookup").run({"ids": [ids]})["embeddings"][0]  # (n, width)
    lab.close("gather_lookup")  # one session at a time: each may hold the table in memory of its own
    bad, _ = differing_bits(out, embed.lookup(rows, ids))
    bad += sum(differing_bits(out[p], out[ids.index(i)])[0] for p, i in enumerate(ids))
    repeated = len(set(ids)) < len(ids)
    return Check("lookup", "gather_lookup", bad == 0, f"Gather(ids={ids}) == embed.lookup bit for bit: {bad} of "
                 f"{out.size} values differ", float(bad), 0.0, {"differing": bad},
                 claim="Gather == embed.lookup, bit for bit" + ("; a repeated id gives one row" if repeated else ""))


def check_onehot(lab, ids, products):
    """OneHot+MatMul's rows against embed.onehot_lookup's (`products` {id: row}, a pass each) and Gather's."""
    vocab, width = lab.values.shape
    out = lab.runner("onehot_lookup").run({"ids": [ids]})["embeddings"][0]
    lab.close("onehot_lookup")
    gathered = lab.runner("gather_lookup").run({"ids": [ids]})["embeddings"][0]
    lab.close("gather_lookup")
    (bad_ref, _), (bad_gather, zeros_gather) = differing_bits(out, [products[i] for i in ids]), \
        differing_bits(out, gathered)
    zeros = f"; {zeros_gather} -0.0 value(s) of the table come out +0.0 (a sum of products)" if zeros_gather else ""
    return Check("onehot_lookup", "onehot_lookup", bad_ref + bad_gather == 0,
                 f"OneHot+MatMul == embed.onehot_lookup ({bad_ref} differ) == Gather ({bad_gather} differ), bit for "
                 f"bit; {len(ids)}x{vocab}x{width} multiplications against Gather's 0{zeros}",
                 float(bad_ref + bad_gather), 0.0,
                 {"differing_reference": bad_ref, "differing_gather": bad_gather, "signed_zeros": zeros_gather},
                 claim=ONEHOT_CLAIM + (" (-0.0 as +0.0)" if zeros else ""))


def scores_and_bounds(rows, query, metric, tokens):
    """({token: embed's score against `query`}, {token: the float32 bound of the graph's score}) for `tokens`:
    gamma_w sum|t_i q_i| for a dot; for a cosine that over the norms plus gamma_(w+4)|cos| (norms, product and
    division), the norms deflated to keep it an upper bound."""
    q = rows[query]
    width, shrink = len(q), 1 - 2 * (len(q) + 2) * U64
    q64 = np.abs(as64(q))
    bound = {t: gamma(width) * float(np.abs(as64(rows[t])) @ q64) * (1 + 2 * (width + 2) * U64) for t in tokens}
    if metric == "dot":
        return {t: embed.dot(rows[t], q) for t in tokens}, bound
    scores = {t: embed.cosine(rows[t], q) for t in tokens}
    norm_q = embed.norm(q) * shrink
    return scores, {t: bound[t] / (embed.norm(rows[t]) * shrink * norm_q) + gamma(width + 4) * abs(scores[t])
                    for t in tokens}


def graph_lists(lab, queries, k, metric, data=None):
    """{query: (ids, scores)}: the graph's k nearest other tokens of each query by `metric` (on data file `data`,
    default the table), from one session, closed after. The table's all-zero rows (lab.zero_rows), whose cosine is
    0/0 in the graph, are left out of a cosine list: k + their count asked for, those dropped (onnxruntime's TopK
    keeps every other score in order beside a NaN)."""
    runner = lab.runner(f"neighbors_{metric}", *([data] if data else []))
    skip = set(lab.zero_rows) if metric == "cosine" else set()
    found = {}
    for query in queries:
        out = runner.run({"ids": [query], "k": [k + len(skip)]})
        kept = [(int(i), float(v)) for i, v in zip(out["indices"][0], out["scores"][0]) if int(i) not in skip][:k]
        found[query] = ([i for i, _ in kept], [v for _, v in kept])
    lab.close(f"neighbors_{metric}")
    return found


def check_neighbors(rows, query, metric, graph, want, shown):
    """The graph's list of `query` by `metric` (`graph`: (ids, scores)) against embed.neighbors' (`want`)."""
    got, got_scores = graph
    k = len(got)
    scores, bounds = scores_and_bounds(rows, query, metric, set(got) | set(want))
    ok_scores, diff, worst = within(got_scores, [scores[t] for t in got], [bounds[t] for t in got])
    moved = differing_positions(got, want, scores, bounds)
    return Check("neighbors", f"neighbors_{metric}", ok_scores and query not in got and moved == 0,
                 f"top {k} of {shown(query)} by {metric}: graph {got} vs embed.neighbors {want}: {moved} positions "
                 f"differ beyond a tie; scores worst diff/bound {worst:.2f}", diff, float(max(bounds.values())),
                 {"query": query, "indices": got, "reference": want},
                 claim=f"top {k} of {shown(query)} by {metric} == embed.neighbors; scores within bound")


def stretch_choice(scores, query, cosine_list):
    """(token, factor): the first of the query's cosine neighbours that points its way and does not lead its dot
    list, and the smallest power of two that makes it lead (embed.lead_factor on `scores`, embed.logits of the
    query's row); None where none can."""
    leader = max((t for t in range(len(scores)) if t != query), key=lambda t: (scores[t], -t))
    for token in cosine_list:
        if token != leader and scores[token] > 0:
            return token, embed.lead_factor(scores, query, token)
    return None


def check_stretch(lab, rows, query, choice, before, reference, shown):
    """A stretched row: the query's cosine list unchanged (graph: `before`, its list on the table; reference:
    `reference` {"before", "cosine", "dot"}, embed.neighbors' cosine list before, and its cosine and dot lists
    after), its dot list now led by it."""
    if choice is None:
        return Check("stretch", "neighbors_*", None, f"none of {shown(query)}'s cosine neighbours points its way "
                     "without leading its dot list already", claim="no row to stretch: the claim does not apply")
    token, factor = choice
    data = lab.stretched(token, factor)
    after, _ = graph_lists(lab, [query], len(before), "cosine", data)[query]
    led, _ = graph_lists(lab, [query], 1, "dot", data)[query]
    stretched = rows.stretched(token, factor)
    scores, bounds = scores_and_bounds(stretched, query, "cosine", set(before) | set(after))
    moved = differing_positions(after, before, scores, bounds)
    same, reference_led = reference["cosine"] == reference["before"], reference["dot"][:1] == [token]
    ok = moved == 0 and same and led == [token] and reference_led
    return Check("stretch", "neighbors_*", ok,
                 f"row {shown(token)} x{factor:g}: {shown(query)}'s cosine list unchanged: {moved} positions differ "
                 f"beyond a tie (embed.neighbors unchanged: {same}); dot list led by {led} (embed: {reference_led})",
                 float(moved + (not same) + (not reference_led)), 0.0, {"token": token, "factor": factor},
                 claim=f"row {shown(token)} x{factor:g}: {shown(query)}'s cosine list unchanged, its dot list led "
                       "by it")


def check_scaled(lab, rows, ids):
    width = lab.values.shape[1]
    out = as64(lab.runner("scaled_lookup").run({"ids": [ids]})["embeddings"][0])
    lab.close("scaled_lookup")
    looked = embed.lookup(rows, ids)
    scaled, looked = as64(embed.scale_sqrt_d(looked)), as64(looked)
    root = math.sqrt(width)
    value_tol, ratio_tol, cos_tol = scaled_tolerances(width)
    ok_values, diff, worst = within(out, scaled, value_tol * np.abs(scaled))
    live = [i for i, r in enumerate(looked) if embed.norm(r) > 0]  # a zero row has no direction to keep
    ratios = np.array([embed.norm(out[i]) / embed.norm(looked[i]) for i in live] or [root])
    cosines = np.array([embed.cosine(out[i], looked[i]) for i in live] or [1.0])
    ok = ok_values and bool(np.all(np.abs(ratios - root) <= ratio_tol)) and bool(np.all(np.abs(cosines - 1) <= cos_tol))
    return Check("scaled", "scaled_lookup", ok,
                 f"values == embed.scale_sqrt_d within 2u relative (worst {worst:.2f}); norm ratios "
                 f"{ratios.min():.9f}..{ratios.max():.9f} vs sqrt({width}) = {root:.9f}", float(np.max(np.abs(
                     cosines - 1))), cos_tol, {"norm_ratios": ratios.tolist(), "diff_is": "max |cosine - 1|"},
                 claim=f"== embed.scale_sqrt_d within 2u: norms x sqrt({width}), directions kept")
