"""Output heads: tied and untied logits against embed.logits, tables in the file and in onnxruntime's memory,
and a hidden vector's own score (tied head), before and after a row is stretched."""
import numpy as np

import embed
import graphs
from runtime.compare.bounds import Check, within
from runtime.resident import copies_held, prepacked_copies


def vocab_width_tensors(model, vocab, width):
    return [t.name for t in model.graph.initializer if sorted(t.dims) == sorted([vocab, width])]


def _head_check(lab, tied):
    name = "tied_logits" if tied else "untied_logits"
    model = lab.model(name)
    want_tables = 1 if tied else 2
    in_file = vocab_width_tensors(model, lab.vocab, lab.width)
    optimized = lab.optimized(name)
    in_memory = vocab_width_tensors(optimized, lab.vocab, lab.width)
    held = copies_held(in_memory, optimized, prepacked_copies(optimized), prepacking=True)  # onnxruntime's defaults
    logits = lab.runner(name).run({"ids": [lab.ids[:1]], "hidden": [lab.hidden]})["logits"][0]  # (4, vocab)
    if tied:
        lab.progress(f"embed.logits over the table for {len(lab.hidden)} hidden vectors")
        exact = [embed.logits(lab.table, h) for h in lab.hidden]
        bound = [lab.dot_bound(lab.table, h) for h in lab.hidden]
    else:
        exact, bound = lab.head_reference()
    ok_values, diff, worst = within(logits, exact, bound)
    values = len(in_file) * lab.vocab * lab.width
    ok = ok_values and len(in_file) == len(in_memory) == held == want_tables and \
        values == embed.param_count(lab.vocab, lab.width, tied=tied)
    return [Check("head", name, ok,
                  f"{len(in_file)} vocab x width tensor(s) in the file {in_file}, {len(in_memory)} in onnxruntime's "
                  f"optimized model, {held} held by a session under its default SessionOptions, prepacked copies "
                  f"counted (want {want_tables}); {values} values == param_count(tied={tied}); logits vs "
                  f"embed.logits({'table' if tied else 'head'}, hidden) for {len(lab.hidden)} hidden vectors, "
                  f"worst diff/bound {worst:.2f}",
                  diff, float(np.max(bound)),
                  {"tables_in_file": in_file, "tables_in_memory": in_memory, "tables_held": held, "worst_ratio": worst,
                   "bound": "gamma_w * sum|a_i b_i| per logit"})]


def check_tied(lab):
    return _head_check(lab, tied=True)


def check_untied(lab):
    return _head_check(lab, tied=False)


def _argmax_ok(graph_logits, exact, bounds):
    """The graph's top token is the reference's, or ties with it within the bounds."""
    g, w = int(np.argmax(graph_logits)), int(np.argmax(exact))
    return g, w, g == w or abs(exact[g] - exact[w]) <= bounds[g] + bounds[w]


def check_self_score(lab):
    runner = lab.runner("tied_logits")
    embeddings = runner.run({"ids": [lab.ids], "hidden": [[lab.table[0]] * len(lab.ids)]})["embeddings"]
    logits = runner.run({"ids": [lab.ids], "hidden": embeddings})["logits"][0]
    own_top, agree = 0, True
    lab.progress(f"embed.logits for hidden = the row of each of {len(lab.ids)} ids")
    for position, token in enumerate(lab.ids):
        row = lab.table[token]
        exact = lab.logits(lab.table, token)
        g, w, ok = _argmax_ok(logits[position], exact, lab.dot_bound(lab.table, row))
        own_top += g == token
        agree &= ok
    checks = [Check("self_score", "tied_logits", agree,
                    f"hidden = the embedding of each id: own score is the top logit for {own_top} of "
                    f"{len(lab.ids)} ids; the graph's top token agrees with embed.logits for all: {agree}")]
    q, s = lab.query, lab.stretch
    scores = lab.logits(lab.table, q)  # hidden = token q's own row
    needed = lab.lead(beat_query=True)
    factor = lab.factor if lab.user_factor else needed
    own_first = max(range(lab.vocab), key=lambda t: (scores[t], -t)) == q
    if needed is None or not own_first or factor * scores[s] <= max(v for t, v in enumerate(scores) if t != s):
        reason = (f"token {s} points away from token {q}" if needed is None else
                  f"token {q}'s own score is not its top logit to begin with" if not own_first else
                  f"x{factor:g} is not enough (x{needed:g} is)")
        checks.append(Check("self_score", "tied_logits", None, f"stretching row {s} to top token {q}'s logits: "
                            f"{reason}; the claim does not apply"))
        return checks
    stretched = lab.stretched(factor)
    logits = lab.runner(f"tied_logits_x{factor:g}", graphs.tied_logits(lab.stretched32(stretched))).run(
        {"ids": [[q]], "hidden": [[lab.table[q]]]})["logits"][0, 0]
    g, w, ok = _argmax_ok(logits, lab.logits(stretched, q), lab.dot_bound(stretched, lab.table[q]))
    checks.append(Check("self_score", "tied_logits", ok and g == s,
                        f"row {s} x{factor:g}: for hidden = row {q}, the top logit moves from {q} (its own) to {g} "
                        f"(reference {w})", None, None, {"token": s, "factor": factor, "top": g}))
    return checks
