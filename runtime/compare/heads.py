"""Output heads: tied and untied logits against embed.logits, tables in the file and in a session's memory, and a
hidden vector's own score (tied head), before and after a row is stretched."""
import numpy as np

import graphs
from runtime.bounds import dot_bounds
from runtime.compare.bounds import Check, dot_bound, within
from runtime.compare.sizes import vocab_width_tensors
from runtime.resident import copies_held, prepacked_copies


def _head_check(config, reference, sessions, tied):
    name = "tied_logits" if tied else "untied_logits"
    vocab, width = config.vocab, config.width
    want_tables = 1 if tied else 2
    in_file = vocab_width_tensors(sessions.model(name), vocab, width)
    optimized = sessions.optimized(name)
    in_memory = vocab_width_tensors(optimized, vocab, width)
    held = copies_held(in_memory, optimized, prepacked_copies(optimized), prepacking=True)  # onnxruntime's defaults
    logits = sessions.runner(name).run({"ids": [list(config.ids[:1])],
                                        "hidden": [reference.hidden]})["logits"][0]  # (4, vocab)
    if tied:
        exact, bound = reference.hidden_logits(), dot_bounds(reference.magnitudes.abs64, reference.hidden, absolute=True)
    else:
        exact, bound = reference.head_logits()
    ok_values, diff, worst = within(logits, exact, bound)
    values = len(in_file) * vocab * width
    ok = ok_values and len(in_file) == len(in_memory) == held == want_tables and \
        values == reference.embed.param_count(vocab, width, tied=tied)
    return [Check("head", name, ok,
                  f"{len(in_file)} vocab x width tensor(s) in the file {in_file}, {len(in_memory)} in onnxruntime's "
                  f"optimized model, {held} held by a session under its default SessionOptions, prepacked copies "
                  f"counted (want {want_tables}); {values} values == param_count(tied={tied}); logits vs "
                  f"embed.logits({'table' if tied else 'head'}, hidden) for {len(reference.hidden)} hidden vectors, "
                  f"worst diff/bound {worst:.2f}",
                  diff, float(np.max(bound)),
                  {"tables_in_file": in_file, "tables_in_memory": in_memory, "tables_held": held, "worst_ratio": worst,
                   "bound": "gamma_w * sum|a_i b_i| per logit"},
                  claim=("held once, in file and memory" if tied else "two tables, in file and memory")
                  + f"; logits match embed.logits({'table' if tied else 'head'}, hidden)")]


def check_tied(config, reference, sessions):
    return _head_check(config, reference, sessions, tied=True)


def check_untied(config, reference, sessions):
    return _head_check(config, reference, sessions, tied=False)


def _argmax_ok(graph_logits, exact, bounds):
    """The graph's top token is the reference's, or ties with it within the bounds."""
    g, w = int(np.argmax(graph_logits)), int(np.argmax(exact))
    return g, w, g == w or abs(exact[g] - exact[w]) <= bounds[g] + bounds[w]


def check_self_score(config, reference, sessions):
    ids, table = list(config.ids), reference.table
    runner = sessions.runner("tied_logits")
    embeddings = runner.run({"ids": [ids], "hidden": [[table[0]] * len(ids)]})["embeddings"]
    logits = runner.run({"ids": [ids], "hidden": embeddings})["logits"][0]
    own_top, disagree = 0, 0
    for position, token in enumerate(ids):
        g, w, ok = _argmax_ok(logits[position], reference.logits(token), dot_bound(reference, table[token]))
        own_top += g == token
        disagree += not ok
    checks = [Check("self_score", "tied_logits", disagree == 0,
                    f"hidden = the embedding of each id: own score is the top logit for {own_top} of {len(ids)} ids; "
                    f"the graph's top token agrees with embed.logits for {len(ids) - disagree} of {len(ids)} (a tie "
                    "within the logits' bounds agrees)", float(disagree), 0.0,
                    claim=f"hidden = each id's own row: top token == embed.logits' ({len(ids) - disagree} of {len(ids)} "
                          "ids)")]
    q, s = config.query, reference.stretch
    scores = reference.logits(q)  # hidden = token q's own row
    needed = reference.lead(beat_query=True)
    factor = reference.factor if reference.user_factor else needed
    own_first = max(range(config.vocab), key=lambda t: (scores[t], -t)) == q
    if needed is None or not own_first or factor * scores[s] <= max(v for t, v in enumerate(scores) if t != s):
        reason = (f"token {s} points away from token {q}" if needed is None else
                  f"token {q}'s own score is not its top logit to begin with" if not own_first else
                  f"x{factor:g} is not enough (x{needed:g} is)")
        checks.append(Check("self_score", "tied_logits", None, f"stretching row {s} to top token {q}'s logits: "
                            f"{reason}; the claim does not apply", claim=f"row {s} to top row {q}'s logits: {reason}"))
        return checks
    logits = sessions.runner(f"tied_logits_x{factor:g}", graphs.tied_logits(reference.at32(factor))).run(
        {"ids": [[q]], "hidden": [[table[q]]]})["logits"][0, 0]
    g, w, ok = _argmax_ok(logits, reference.logits(q, factor), dot_bound(reference, table[q], factor))
    checks.append(Check("self_score", "tied_logits", ok and g == s,
                        f"row {s} x{factor:g}: for hidden = row {q}, the top logit moves from {q} (its own) to {g} "
                        f"(reference {w}; want {s})", float(not (ok and g == s)), 0.0,
                        {"token": s, "factor": factor, "top": g},
                        claim=f"row {s} x{factor:g} moves the top token for hidden = row {q} from {q} to {g}"))
    return checks
