"""python -m runtime.compare: build every graph, run it in onnxruntime, and check each claim against embed.py.

One line per check: PASS/FAIL (or N/A where the chosen inputs make a claim not apply), what was
compared, the measured difference and the tolerance used. Float32 scores are held to float32's
error bound for a sum of `width` products, |s - exact| <= gamma_w * sum|a_i b_i| with
gamma_w = w u / (1 - w u), u = 2**-24; lookups are held to the bit.
"""
import argparse
import json
import math
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

import embed
import graphs
from graphs.export import build_all
from graphs.storage import data_path
from runtime.runner import Runner, optimized_model

U = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53  # float64's, for the reference's own arithmetic


def gamma(n):
    """Higham's gamma_n: the relative bound on n float32 roundings in a row."""
    return n * U / (1 - n * U)


@dataclass
class Check:
    name: str
    graph: str
    passed: bool | None  # None: the claim does not apply to the inputs chosen
    detail: str
    diff: float | None = None
    tolerance: float | None = None
    values: dict = field(default_factory=dict)

    def line(self):
        status = {True: "PASS", False: "FAIL", None: "N/A "}[self.passed]
        measured = "" if self.diff is None else f" | diff {self.diff:.3g} (tolerance {self.tolerance:.3g})"
        return f"{status} | {self.name:<16} | {self.graph:<16} | {self.detail}{measured}"


def as64(values):
    return np.asarray(values, dtype=np.float64)


def differing(a, b):
    """How many values differ in their bits (float32 graph output against float32-exact reference floats)."""
    a, b = as64(a), as64(b)
    if a.shape != b.shape:
        return max(a.size, b.size)
    return int(np.count_nonzero(a.view(np.uint64) != b.view(np.uint64)))


def vocab_width_tensors(model, vocab, width):
    return [t.name for t in model.graph.initializer if sorted(t.dims) == sorted([vocab, width])]


def within(got, exact, bound):
    """(passed, max |diff|, worst diff / bound); NaN never passes."""
    got, exact, bound = as64(got), as64(exact), as64(bound)
    diff = np.abs(got - exact)
    ok = bool(np.all(diff <= bound)) and not np.isnan(got).any()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(diff == 0, 0.0, diff / bound)  # a difference against a zero bound is infinitely over
    return ok, float(np.max(diff)), float(np.max(ratio))  # NaN shows as nan in both


class Lab:
    """The configuration, the reference tables, and one place to put files."""

    def __init__(self, args, folder):
        self.vocab, self.width, self.seed = args.vocab_size, args.width, args.seed
        self.ids, self.query, self.k = args.ids, args.query, args.k
        self.folder = folder
        self.table = embed.make_table(self.vocab, self.width, self.seed)  # the truth, in Python floats
        self.head = embed.make_table(self.vocab, self.width, self.seed + 1)
        self.hidden = embed.make_table(4, self.width, self.seed + 2)  # float32-exact hidden vectors
        self.models = build_all(self.vocab, self.width, self.seed)  # graphs build from graphs.make_table
        self.runners = {}
        self.stretch, self.factor, self.user_factor = args.stretch, args.factor, args.factor is not None
        if self.stretch is None:  # the best dot neighbour that does not already lead
            ranked = embed.neighbors(self.table, self.query, self.vocab, "dot")
            self.stretch = ranked[1] if len(ranked) > 1 else ranked[0]
        if self.factor is None:
            self.factor = embed.stretch_to_lead(self.table, self.query, self.stretch) or 2.0

    def model(self, name):
        return self.models[f"{name}.onnx"]

    def runner(self, name):
        """One session per exported graph, made on first use."""
        if name not in self.runners:
            self.runners[name] = Runner(self.model(name))
        return self.runners[name]

    def optimized(self, name):
        return optimized_model(self.model(name), self.folder, f"{name}.optimized.onnx")

    def dot_bound(self, rows, vector):
        """gamma_w * sum|a_i b_i| for each row: the float32 error bound of each dot product."""
        return [gamma(self.width) * math.fsum(abs(a * b) for a, b in zip(row, vector)) for row in rows]


def check_table(lab):
    model = lab.model("gather_lookup")
    tensor = [t for t in model.graph.initializer if t.name == "embedding"][0]
    values = numpy_helper.to_array(tensor)
    bad = differing(values, lab.table)
    count = embed.param_count(lab.vocab, lab.width)
    ok = bad == 0 and values.size == count
    return [Check("table", "gather_lookup", ok,
                  f"'embedding' == embed.make_table({lab.vocab}, {lab.width}, {lab.seed}) bit for bit: "
                  f"{bad} of {values.size} values differ; {values.size} values, param_count {count}",
                  0.0 if bad == 0 else 1.0, 0.0, {"differing": bad, "elements": int(values.size), "param_count": count})]


def check_gather(lab):
    out = lab.runner("gather_lookup").run({"ids": [lab.ids]})["embeddings"][0]  # (n, width)
    bad = differing(out, embed.lookup(lab.table, lab.ids))
    repeats = {i for i in lab.ids if lab.ids.count(i) > 1}
    same = all(differing(out[p], out[lab.ids.index(i)]) == 0 for p, i in enumerate(lab.ids))
    note = (f"repeated id{'s' if len(repeats) > 1 else ''} {sorted(repeats)}: same vector at every position: {same}"
            if repeats else "no repeated id in --ids")
    return [Check("lookup", "gather_lookup", bad == 0 and same,
                  f"Gather(ids={lab.ids}) == embed.lookup bit for bit ({bad} of {out.size} differ); {note}",
                  float(bad > 0), 0.0, {"differing": bad, "repeats_identical": same})]


def check_onehot(lab):
    model = lab.model("onehot_lookup")
    out = lab.runner("onehot_lookup").run({"ids": [lab.ids]})["embeddings"][0]
    gathered = lab.runner("gather_lookup").run({"ids": [lab.ids]})["embeddings"][0]
    reference, reference_products = embed._onehot_rows(lab.table, lab.ids)
    bad_ref, bad_gather = differing(out, reference), differing(out, gathered)
    # MatMul([n, vocab] one-hot, [vocab, width] table): n * vocab * width products, counted from the graph
    hot_dims = {v.name: v.type.tensor_type.shape.dim for v in model.graph.value_info}["one_hot"]
    graph_products = len(lab.ids) * hot_dims[-1].dim_value * lab.width
    expected = len(lab.ids) * lab.vocab * lab.width
    ok = bad_ref == 0 and bad_gather == 0 and graph_products == reference_products == expected
    return [Check("onehot_lookup", "onehot_lookup", ok,
                  f"OneHot+MatMul == embed.onehot_lookup ({bad_ref} differ) == Gather ({bad_gather} differ), bit "
                  f"for bit; multiplications: Gather 0, one-hot {graph_products} = {len(lab.ids)}x{lab.vocab}x"
                  f"{lab.width} (reference did {reference_products})",
                  float(bad_ref + bad_gather > 0), 0.0,
                  {"multiplications_gather": 0, "multiplications_onehot": graph_products})]


def _head_check(lab, tied):
    name = "tied_logits" if tied else "untied_logits"
    model = lab.model(name)
    head = lab.table if tied else lab.head
    want_tables = 1 if tied else 2
    in_file = vocab_width_tensors(model, lab.vocab, lab.width)
    in_memory = vocab_width_tensors(lab.optimized(name), lab.vocab, lab.width)
    logits = lab.runner(name).run({"ids": [lab.ids[:1]], "hidden": [lab.hidden]})["logits"][0]  # (4, vocab)
    exact = [embed.logits(head, h) for h in lab.hidden]
    bound = [lab.dot_bound(head, h) for h in lab.hidden]
    ok_values, diff, worst = within(logits, exact, bound)
    values = len(in_file) * lab.vocab * lab.width
    ok = ok_values and len(in_file) == len(in_memory) == want_tables and \
        values == embed.param_count(lab.vocab, lab.width, tied=tied)
    return [Check("head", name, ok,
                  f"{len(in_file)} vocab x width tensor(s) in the file {in_file}, {len(in_memory)} in onnxruntime's "
                  f"optimized model (want {want_tables}); {values} values == param_count(tied={tied}); logits vs "
                  f"embed.logits({'table' if tied else 'head'}, hidden) for {len(lab.hidden)} hidden vectors, "
                  f"worst diff/bound {worst:.2f}",
                  diff, float(np.max(bound)),
                  {"tables_in_file": in_file, "tables_in_memory": in_memory, "worst_ratio": worst,
                   "bound": "gamma_w * sum|a_i b_i| per logit"})]


def check_tied(lab):
    return _head_check(lab, tied=True)


def check_untied(lab):
    return _head_check(lab, tied=False)


def _file_bytes(lab, model, name):
    path = os.path.join(lab.folder, name)
    graphs.save(model, path, overwrite=True)
    return os.path.getsize(path) + (os.path.getsize(data_path(path)) if os.path.exists(data_path(path)) else 0)


def check_sizes(lab):
    checks = []
    table_bytes = 4 * lab.vocab * lab.width
    doubled = graphs.make_table(2 * lab.vocab, lab.width, lab.seed)
    doubled_head = graphs.make_table(2 * lab.vocab, lab.width, lab.seed + 1)
    sizes = {}
    for vocab, tied_model, untied_model in (
            (lab.vocab, lab.model("tied_logits"), lab.model("untied_logits")),
            (2 * lab.vocab, graphs.tied_logits(doubled), graphs.untied_logits(doubled, doubled_head))):
        for tied, model in ((True, tied_model), (False, untied_model)):
            counted = sum(math.prod(t.dims) for t in model.graph.initializer if list(t.dims) == [vocab, lab.width])
            sizes[vocab, tied] = (counted, _file_bytes(lab, model, f"sizes_{vocab}_{tied}.onnx"))
    # The files differ by whole tables, give or take names, docs and length prefixes: under 1 KiB.
    overhead = 1024
    for label, (a, b), claim in (("untied - tied", ((lab.vocab, True), (lab.vocab, False)), "a second table"),
                                 ("tied, vocab x2", ((lab.vocab, True), (2 * lab.vocab, True)), "the added rows")):
        extra_values = sizes[b][0] - sizes[a][0]
        extra_bytes = sizes[b][1] - sizes[a][1]
        ok = extra_values == lab.vocab * lab.width and abs(extra_bytes - table_bytes) <= overhead
        checks.append(Check("sizes", "tied/untied", ok,
                            f"{label}: +{extra_values} values, +{extra_bytes} bytes on disk = {claim} "
                            f"({table_bytes} bytes) {extra_bytes - table_bytes:+d} bytes of names, docs and headers",
                            float(abs(extra_bytes - table_bytes)), float(overhead), {}))
    expected = {(v, t): embed.param_count(v, lab.width, tied=t) for v, t in sizes}
    ok = all(sizes[key][0] == expected[key] for key in sizes)
    listing = ", ".join(f"V={v} {'tied' if t else 'untied'} {sizes[v, t][0]} values/{sizes[v, t][1]} B"
                        for v, t in sorted(sizes, key=lambda key: (key[0], not key[1])))
    checks.insert(0, Check("sizes", "tied/untied", ok, f"values held == embed.param_count: {listing}", None, None,
                           {f"{v}_{'tied' if t else 'untied'}": {"values": sizes[v, t][0], "bytes": sizes[v, t][1]}
                            for v, t in sizes}))
    return checks


def _score_bounds(lab, table, query, metric):
    """Reference scores of every token against `query`, and the float32 bound of the graph's score of each."""
    q = table[query]
    dots = [embed.dot(row, q) for row in table]
    bounds = lab.dot_bound(table, q)
    if metric == "dot":
        return dots, bounds
    norms = [embed.norm(row) for row in table]
    cos = [d / (n * norms[query]) for d, n in zip(dots, norms)]
    # the dot's bound scaled by the norms, plus the norms' sums, the square roots, the product and the division
    return cos, [b / (n * norms[query]) + gamma(lab.width + 4) * abs(c) for b, n, c in zip(bounds, norms, cos)]


def _compare_lists(got, want, scores, bounds):
    """Exact, except where the reference scores of the two tokens are within their bounds of each other."""
    if len(got) != len(want):
        return False
    return all(g == w or abs(scores[g] - scores[w]) <= bounds[g] + bounds[w] for g, w in zip(got, want))


def _neighbors(lab, table, metric, exported=False):
    """The graph's neighbour list of the query: the exported graph's session, or a new graph for `table`."""
    runner = lab.runner(f"neighbors_{metric}") if exported else Runner(
        graphs.neighbors(np.asarray(table, dtype=np.float32), metric))
    out = runner.run({"ids": [lab.query], "k": [lab.k]})
    return [int(i) for i in out["indices"][0]], out["scores"][0]


def check_neighbors(lab):
    checks = []
    for metric in ("cosine", "dot"):
        got, got_scores = _neighbors(lab, lab.table, metric, exported=True)
        want = embed.neighbors(lab.table, lab.query, lab.k, metric)
        scores, bounds = _score_bounds(lab, lab.table, lab.query, metric)
        ok_scores, diff, worst = within(got_scores, [scores[t] for t in got], [bounds[t] for t in got])
        ok = ok_scores and lab.query not in got and _compare_lists(got, want, scores, bounds)
        checks.append(Check("neighbors", f"neighbors_{metric}", ok,
                            f"top {lab.k} of token {lab.query} by {metric}: graph {got[:8]}{'...' if len(got) > 8 else ''}"
                            f" vs embed.neighbors {want[:8]}{'...' if len(want) > 8 else ''}; scores worst diff/bound "
                            f"{worst:.2f}", diff, float(max(bounds)), {"indices": got, "reference": want}))
    checks.append(check_stretch(lab))
    return checks


def check_stretch(lab):
    q, s, factor = lab.query, lab.stretch, lab.factor
    graph = "neighbors_*"
    before_dot = embed.neighbors(lab.table, q, lab.vocab, "dot")
    if embed.dot(lab.table[s], lab.table[q]) <= 0:
        return Check("stretch", graph, None, f"token {s} points away from token {q} (dot "
                     f"{embed.dot(lab.table[s], lab.table[q]):.3g} <= 0): stretching it only pushes it down the "
                     "dot list, so the claim does not apply; pick another --stretch")
    if before_dot[0] == s:
        return Check("stretch", graph, None, f"token {s} already leads token {q}'s dot list before stretching: "
                     "nothing to show; pick another --stretch")
    stretched = embed.stretch_row(lab.table, s, factor)
    if embed.neighbors(stretched, q, 1, "dot") != [s]:
        return Check("stretch", graph, None, f"x{factor:g} is not enough for token {s} to lead token {q}'s dot list "
                     f"(x{embed.stretch_to_lead(lab.table, q, s):g} is); the claim does not apply")
    before_cos, _ = _neighbors(lab, lab.table, "cosine", exported=True)
    after_cos, _ = _neighbors(lab, stretched, "cosine")
    after_dot, _ = _neighbors(lab, stretched, "dot")
    scores, bounds = _score_bounds(lab, stretched, q, "cosine")
    cos_same = _compare_lists(after_cos, before_cos, scores, bounds)
    ok = cos_same and after_dot[:1] == [s] and embed.neighbors(stretched, q, lab.k) == embed.neighbors(lab.table, q, lab.k)
    return Check("stretch", graph, ok,
                 f"row {s} x{factor:g}: cosine list of {q} unchanged: {cos_same}; dot list now led by {after_dot[:1]} "
                 f"(was rank {before_dot.index(s) + 1})", None, None,
                 {"token": s, "factor": factor, "dot_after": after_dot, "cosine_after": after_cos})


def check_scaled(lab):
    out = as64(lab.runner("scaled_lookup").run({"ids": [lab.ids]})["embeddings"][0])
    rows = as64(embed.lookup(lab.table, lab.ids))
    reference = as64(embed.lookup(embed.scale_sqrt_d(lab.table), lab.ids))
    root = math.sqrt(lab.width)
    # float32(sqrt(w)) and the product: two roundings of at most u each, relative
    ok_values, diff, worst = within(out, reference, 2 * U * (1 + U) * np.abs(reference))
    ratios = np.array([embed.norm(o) / embed.norm(r) for o, r in zip(out, rows)])
    ratio_tol = root * (2 * U * (1 + U) + (lab.width + 4) * U64)
    cosines = np.array([embed.cosine(o, r) for o, r in zip(out, rows)])
    cos_tol = 2 * U * U + (lab.width + 4) * U64  # values off by <= 2u relative turn a cosine by <= (2u)^2 / 2
    ok = ok_values and bool(np.all(np.abs(ratios - root) <= ratio_tol)) and bool(np.all(np.abs(cosines - 1) <= cos_tol))
    return [Check("scaled", "scaled_lookup", ok,
                  f"values == embed.scale_sqrt_d within 2u relative (worst {worst:.2f}); norm ratio "
                  f"{ratios.min():.9f}..{ratios.max():.9f} vs sqrt({lab.width}) = {root:.9f} (tolerance "
                  f"{ratio_tol:.2g})", float(np.max(np.abs(cosines - 1))), cos_tol,
                  {"norm_ratios": ratios.tolist(), "cosines": cosines.tolist(), "diff_is": "max |cosine - 1|"})]


def _argmax_ok(graph_logits, exact, bounds):
    """The graph's top token is the reference's, or ties with it within the bounds."""
    g, w = int(np.argmax(graph_logits)), int(np.argmax(exact))
    return g, w, g == w or abs(exact[g] - exact[w]) <= bounds[g] + bounds[w]


def check_self_score(lab):
    runner = lab.runner("tied_logits")
    embeddings = runner.run({"ids": [lab.ids], "hidden": [[lab.table[0]] * len(lab.ids)]})["embeddings"]
    logits = runner.run({"ids": [lab.ids], "hidden": embeddings})["logits"][0]
    own_top, agree = 0, True
    for position, token in enumerate(lab.ids):
        row = lab.table[token]
        g, w, ok = _argmax_ok(logits[position], embed.logits(lab.table, row), lab.dot_bound(lab.table, row))
        own_top += g == token
        agree &= ok
    checks = [Check("self_score", "tied_logits", agree,
                    f"hidden = the embedding of each id: own score is the top logit for {own_top} of "
                    f"{len(lab.ids)} ids; the graph's top token agrees with embed.logits for all: {agree}")]
    q, s = lab.query, lab.stretch
    scores = embed.logits(lab.table, lab.table[q])  # hidden = token q's own row
    needed = embed.stretch_to_lead(lab.table, q, s, beat_query=True)
    factor = lab.factor if lab.user_factor else needed
    own_first = max(range(lab.vocab), key=lambda t: (scores[t], -t)) == q
    if needed is None or not own_first or factor * scores[s] <= max(v for t, v in enumerate(scores) if t != s):
        reason = (f"token {s} points away from token {q}" if needed is None else
                  f"token {q}'s own score is not its top logit to begin with" if not own_first else
                  f"x{factor:g} is not enough (x{needed:g} is)")
        checks.append(Check("self_score", "tied_logits", None, f"stretching row {s} to top token {q}'s logits: "
                            f"{reason}; the claim does not apply"))
        return checks
    stretched = embed.stretch_row(lab.table, s, factor)
    logits = Runner(graphs.tied_logits(np.asarray(stretched, dtype=np.float32))).run(
        {"ids": [[q]], "hidden": [[lab.table[q]]]})["logits"][0, 0]
    g, w, ok = _argmax_ok(logits, embed.logits(stretched, lab.table[q]), lab.dot_bound(stretched, lab.table[q]))
    checks.append(Check("self_score", "tied_logits", ok and g == s,
                        f"row {s} x{factor:g}: for hidden = row {q}, the top logit moves from {q} (its own) to {g} "
                        f"(reference {w})", None, None, {"token": s, "factor": factor, "top": g}))
    return checks


CHECKS = [check_table, check_gather, check_onehot, check_tied, check_untied, check_sizes, check_neighbors,
          check_scaled, check_self_score]


class UsageError(Exception):
    """Bad usage or input: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: error: {message}")


def parse(argv):
    parser = _Parser(prog="python -m runtime.compare", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    add = parser.add_argument
    add("--vocab-size", type=int, default=4096, help="rows in the table (default 4096)")
    add("--width", type=int, default=96, help="values per row (default 96; sqrt(96) is not a float32)")
    add("--seed", type=int, default=0, help="table seed; the untied head uses seed+1, hidden vectors seed+2")
    add("--ids", type=embed._ids, default=[3, 3, 17], help="ids to look up (default 3,3,17)")
    add("--query", type=int, default=0, help="token whose neighbours are checked (default 0)")
    add("--k", type=int, default=8, help="neighbours to list (default 8)")
    add("--stretch", type=int, help="token whose row is stretched (default: the query's best dot neighbour "
                                    "that does not already lead)")
    add("--factor", type=float, help="stretch factor (default: the smallest power of two that makes it lead)")
    add("--json", metavar="PATH|-", help="write the results as JSON ('-': standard output, the report to stderr)")
    add("--export", metavar="DIR", help="also write the seven graphs there (never overwrites)")
    args = parser.parse_args(argv)
    try:
        embed.param_count(args.vocab_size, args.width)
        if args.vocab_size < 2:
            raise ValueError(f"--vocab-size must be >= 2, got {args.vocab_size}")
        if args.vocab_size * args.width > 2**26:
            raise ValueError(f"--vocab-size x --width must be <= {2**26} (the reference is pure Python)")
        if not args.ids:
            raise ValueError("--ids needs at least one id")
        embed._check_ids(args.ids + [args.query] + ([args.stretch] if args.stretch is not None else []),
                         args.vocab_size)
        embed._check_int("k", args.k, 0)
        if args.factor is not None:
            embed._check_factor(args.factor)
        if args.stretch == args.query:
            raise ValueError(f"--stretch {args.stretch} is the query itself; pick another token")
        if args.export and os.path.exists(args.export) and not os.path.isdir(args.export):
            raise ValueError(f"--export {args.export} exists and is not a folder")
        if args.export:
            taken = [name for name in graphs.export.FILES if os.path.lexists(os.path.join(args.export, name))]
            if taken:
                raise ValueError(f"--export: {os.path.join(args.export, taken[0])} exists; refusing to overwrite")
    except (TypeError, ValueError, IndexError) as e:
        parser.error(str(e))
    return args


def _write_json(path, data):
    text = json.dumps(data, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".compare-", suffix=".json", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)


def main(argv=None):
    try:
        args = parse(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    report = sys.stderr if args.json == "-" else sys.stdout
    with tempfile.TemporaryDirectory(prefix="onnx-lab-compare-") as folder:
        lab = Lab(args, folder)
        print(f"embedding-onnx-lab compare: vocab {lab.vocab}, width {lab.width}, seed {lab.seed}, ids {lab.ids}, "
              f"query {lab.query}, k {lab.k}; onnxruntime {ort.__version__}, onnx {onnx.__version__}", file=report)
        checks = []
        for run_check in CHECKS:
            for check in run_check(lab):
                checks.append(check)
                print(check.line(), file=report, flush=True)
        if args.export:
            os.makedirs(args.export, exist_ok=True)
            for name, model in lab.models.items():
                graphs.save(model, os.path.join(args.export, name))
            print(f"wrote {len(lab.models)} graphs to {args.export}", file=report)
    failed = sum(c.passed is False for c in checks)
    skipped = sum(c.passed is None for c in checks)
    print(f"{len(checks) - failed - skipped} passed, {failed} failed, {skipped} not applicable", file=report)
    if args.json:
        config = {"vocab_size": lab.vocab, "width": lab.width, "seed": lab.seed, "ids": lab.ids, "query": lab.query,
                  "k": lab.k, "stretch": lab.stretch, "factor": lab.factor, "onnxruntime": ort.__version__,
                  "onnx": onnx.__version__, "u": U}
        _write_json(args.json, {"passed": failed == 0, "config": config, "checks": [asdict(c) for c in checks]})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
