"""compare --model: read the table, run the lab's checks on it, measure what it shows, report."""
import sys
import tempfile
from dataclasses import asdict

import numpy as np
import onnx
import onnxruntime as ort

import embed
from graphs.arrays import release
from graphs.outputs import write_json
from runtime.compare.bounds import Check, summary
from runtime.compare.real import checks, figures, report, untrained, verify
from runtime.compare.real.lab import Lab
from runtime.compare.real.pool import ReferencePool
from runtime.compare.real.rows import Rows
from runtime.compare.real.source import find_table
from runtime.compare.real.tokens import resolve, vocabulary_of
from runtime.model.read.text import InspectError, printable
from runtime.progress import Progress
from runtime.resident import give_back_heap

DEFAULT_QUERIES = (" Paris", " king", " water")  # tried with a tokenizer; those that make one token are used


def default_queries(vocabulary, lengths):
    """(ids, why): the queries when none is given: the words of DEFAULT_QUERIES the tokenizer makes one token each
    (why None), else the rows of median, shortest and longest length, and why in one line; an all-zero row (no
    direction) is never one."""
    made = [vocabulary.encode(word) for word in DEFAULT_QUERIES]
    ids = [m[0] for m in made if m is not None and len(m) == 1 and 0 <= m[0] < len(lengths) and lengths[m[0]] > 0]
    if ids:
        return list(dict.fromkeys(ids)), None
    order = [t for t in np.argsort(lengths, kind="stable") if lengths[t] > 0]
    words = ", ".join(repr(w) for w in DEFAULT_QUERIES)
    why = (f"no tokenizer to make {words} tokens" if all(m is None for m in made) else
           f"the tokenizer makes none of {words} one token")
    return (list(dict.fromkeys(int(t) for t in (order[len(order) // 2], order[0], order[-1]))),
            f"no --query given and {why}:\nthe lists below are of the rows of median, shortest and longest length")


def _header(table, path):
    vocab, width = table.shape
    tie = "tied" if table.tied else "untied" if table.scored else "no head"
    return (f"embedding-onnx-lab compare --model {printable(path)}\ntable {printable(table.name)}: {vocab} x {width} "
            f"(vocab x width), {table.format} read as float32, {tie}\nonnxruntime {ort.__version__}, onnx "
            f"{onnx.__version__}")  # three lines: a long name or path stays within the report's width


def _submitted(pool, queries, ids, k):
    """The reference passes the checks need, started in the workers at once, first the one the stretch waits on:
    {"first": the first query's lists and dot scores, "rest": the other queries' lists, ("onehot", id): rows}."""
    passes = {"first": pool.submit("scores", queries[:1], (k, True))}
    if queries[1:]:
        passes["rest"] = pool.submit("scores", queries[1:], (k, False))
    for token_id in dict.fromkeys(ids):  # a repeated id is the same product: one pass
        passes[("onehot", token_id)] = pool.submit("onehot", argument=[token_id])
    return passes


class _Stretch:
    """The stretch check's reference pass, started in the workers as soon as the first query's scores pass (its
    dot products choose the row) has ended: poll() between the long steps, result() at the check."""

    def __init__(self, pool, first, query, before):
        self.pool, self.first, self.query, self.before = pool, first, query, before
        self.choice, self.after = None, None

    def poll(self):
        if self.first is None or not self.first.ready():
            return
        self.choice = checks.stretch_choice(self.first.get()[self.query]["logits"], self.query, self.before)
        if self.choice is not None:
            self.after = self.pool.submit("scores", [self.query], (len(self.before), False), self.choice)
        self.first = None

    def result(self):
        """(choice, embed's lists after the stretch, {} without a choice)."""
        if self.first is not None:
            self.first.wait()
            self.poll()
        return self.choice, self.after.get()[self.query] if self.after else {}


def _measure(config, table, lab, vocabulary, progress, say, queries):
    """(checks, lists, lengths, self-score, hub counts): the lab's checks and the figures, lists printed first;
    `queries` the ids asked for (None: the defaults). The reference's passes run in two worker processes
    meanwhile."""
    lengths = figures.norms(lab.values)
    if not queries:
        queries, why = default_queries(vocabulary, lengths)
        if why:
            say(why + "\n")
    ids = list(config.ids) if config.ids else queries[:2] + queries[:1]  # a repeated id: the same row at both places
    rows, k, shown = Rows(lab.values), min(config.k, table.vocab - 1), vocabulary.shown
    pool = ReferencePool(lab.data, lab.values.shape)
    try:
        passes = _submitted(pool, queries, ids, k)
        progress("the lab's graphs, written on the table (embed's passes in the workers)")
        lab.build()
        progress("neighbours: the graphs")
        graph = {m: checks.graph_lists(lab, queries, k, m) for m in ("cosine", "dot")}
        for query in queries:
            say(report.side_by_side(vocabulary, lengths, query, graph["cosine"][query], graph["dot"][query]) + "\n")
        before = graph["cosine"][queries[0]][0]
        stretch = _Stretch(pool, passes["first"], queries[0], before)
        step = lambda stage: (stretch.poll(), progress(stage))  # each long step starts it if it can
        scores = figures.self_score(lab.values, step)
        release(lab.values)  # read whole: its pages go back to the page cache until a check reads a row again
        step("hubs: the rows that lead sampled tokens' lists")
        counts = figures.hubs(lab, k)
        step("the checks: lookups, neighbours, a stretched row, the scaling (waiting on embed's passes)")
        lists = {q: {m: graph[m][q] for m in graph} for q in queries}
        found = [checks.check_lookup(lab, rows, ids),
                 checks.check_onehot(lab, ids, {i: passes[("onehot", i)].get()[0] for i in dict.fromkeys(ids)})]
        reference = {**passes["first"].get(), **(passes["rest"].get() if "rest" in passes else {})}
        found += [checks.check_neighbors(rows, q, m, lists[q][m], reference[q][m], shown)
                  for q in queries for m in ("cosine", "dot")]
        choice, after = stretch.result()
        wanted = {"before": reference[queries[0]]["cosine"], **after}
        found.append(checks.check_stretch(lab, rows, queries[0], choice, before, wanted, shown))
        found.append(checks.check_scaled(lab, rows, ids))
        lab.close()
    finally:
        pool.close()
    return found, lists, lengths, scores, counts


_ROWS_AT_ONCE = 1 << 14  # rows scanned for non-finite values at a time
_LENGTH_MOST = float(np.sqrt(np.finfo(np.float32).max)) / 2  # a row whose squared length float32 holds, with room


def check_values(table):
    """InspectError (one line) for a table the lab cannot say true things of: fewer than two rows (no other token to
    rank), a NaN or an infinity anywhere (float16 overflow included), naming the first such row and column, or a row
    whose squared length would overflow float32 (the graphs' norms); checked on the decoded values before any graph
    runs. Sets table.zero_rows; fewer than two rows with a direction: InspectError."""
    if table.vocab < 2:
        raise InspectError(f"table {table.name}: {table.vocab} row: no other token to rank; compare --model needs at "
                           "least two")
    values, zero = table.values, []
    for t0 in range(0, table.vocab, _ROWS_AT_ONCE):
        block = np.asarray(values[t0:t0 + _ROWS_AT_ONCE])
        bad = ~np.isfinite(block)
        if bad.any():
            row, column = (int(i) for i in np.argwhere(bad)[0])
            what = "NaN" if np.isnan(block[row, column]) else f"{block[row, column]:+}"
            raise InspectError(f"table {table.name}: row {t0 + row} holds {what} (column {column}): the lab compares "
                               "finite values only; nothing was run")
        zero += (t0 + np.flatnonzero(~block.any(axis=1))).tolist()
        largest = np.max(np.abs(block), axis=1)
        over = np.flatnonzero(largest.astype(np.float64) * np.sqrt(table.width) > _LENGTH_MOST)
        if len(over):
            row = int(over[0])
            raise InspectError(f"table {table.name}: row {t0 + row}'s length overflows float32 (its largest |value| "
                               f"{largest[row]:.3g}): the graphs square and sum rows in float32; nothing was run")
    if table.vocab - len(zero) < 2:
        raise InspectError(f"table {table.name}: {table.vocab - len(zero)} of its {table.vocab} rows not all zeros: "
                           "no two directions to compare")
    table.zero_rows = zero


def check_queries(table, ids):
    """UsageError naming a query that is an all-zero row: it has no direction, so no cosine list."""
    zero = set(table.zero_rows)
    bad = next((i for i in ids or () if i in zero), None)
    if bad is not None:
        raise embed.UsageError(f"--query {bad}: row {bad} is all zeros (a padding row): it has no direction to rank "
                               "others by; give another")


def _check_ids(ids, vocab):
    """UsageError naming an --ids id outside the table's rows."""
    bad = next((i for i in ids or () if not 0 <= i < vocab), None)
    if bad is not None:
        raise embed.UsageError(f"--ids: {bad} is out of range [0, {vocab}) (the table's rows)")


def _verified(config, table, vocabulary, under, progress, queries):
    """--verify-under-trained's INFO Check (the `queries` asked too, as controls); its answer set as `under`'s
    "verified"."""
    if under is None:
        said = "under-trained: not verified: no candidates were looked for (the line above says why)"
    else:
        progress(f"under-trained tokens: the model asked to copy the top {config.verify}")
        under["verified"] = verify.verify(table, vocabulary, under["candidates"], config.verify, queries)
        said = verify.line(under["verified"])
    return Check("under_trained", "the model, run", None, said, info=True, claim=said)


def run(config):
    """compare --model's run: 0 all checks pass, 1 any fails, 2 a model that cannot be read or a bad query."""
    progress = Progress(enabled=config.json != "-")
    out = sys.stderr if config.json == "-" else sys.stdout
    say = lambda text: (progress.done(), print(text, file=out, flush=True))
    try:
        progress(f"reading {config.model}")
        table = find_table(config.model, config.table)
        vocabulary = vocabulary_of(table)
        give_back_heap()  # the tokenizer's parse: freed, yet resident
        queries = resolve(config.queries, vocabulary, table.vocab) if config.queries else None  # refused before work
        _check_ids(config.ids, table.vocab)
        progress(f"decoding {table.name} ({table.vocab} x {table.width}, {table.format})")
        table.read()
        check_values(table)
        check_queries(table, queries)
        with tempfile.TemporaryDirectory(prefix="onnx-lab-compare-model-") as folder:
            lab = Lab(table.values, folder, table.zero_rows)
            table.values = lab.values  # the decoded copy goes; the data file's map is the table from here on
            say(_header(table, config.model) + "\n")
            found, lists, lengths, scores, counts = _measure(config, table, lab, vocabulary, progress, say,
                                                                       queries)
            longest = [int(t) for t in np.argsort(-lengths, kind="stable")[:config.k]]
            found += report.table_lines(table, lengths, vocabulary, longest[:5])
            found += [report.self_score_line(vocabulary, lengths, scores), report.hubs_line(vocabulary, counts)]
            progress("under-trained tokens: each row against the unused ones")
            under = untrained.indicator(lab.values, vocabulary, table.tied, max(untrained.SHOWN, config.verify or 0))
            found.append(untrained.check(under, table.tied))
            if config.verify:
                release(lab.values)  # read whole again by the indicator: the model's session comes next
                found.append(_verified(config, table, vocabulary, under, progress, list(lists)))
            data = report.table_json(table, vocabulary, lengths, longest, lists, scores, counts)
            data["under_trained"] = under
            lab.close()
    except (InspectError, embed.UsageError) as e:
        progress.done()
        print(f"python -m runtime.compare: error: {printable(str(e))}", file=sys.stderr)
        return 2
    progress.done()
    for check in found:
        say(check.line())
        if (config.verbose or check.passed is False) and check.details():
            say(check.details())
    failed, line = summary(found)
    say(line)
    if config.json:
        _write_json(config, failed, found, data)
    if config.plot:
        from runtime.compare.real.plot import plot  # matplotlib is optional: imported only when asked for
        plot(config.plot, data, lengths)
    return 1 if failed else 0


def _write_json(config, failed, found, data):
    write_json(config.json, {"passed": failed == 0, "config": {**config.as_dict(), "onnxruntime": ort.__version__,
                                                               "onnx": onnx.__version__},
                             "checks": [asdict(c) for c in found], "table": data})
