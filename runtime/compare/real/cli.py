"""compare --model: read the table, run the lab's checks on it, measure what it shows, report."""
import json
import sys
import tempfile
from dataclasses import asdict

import numpy as np
import onnx
import onnxruntime as ort

import embed
from graphs.storage import write_text
from runtime.compare.real import checks, figures, report
from runtime.compare.real.lab import Lab
from runtime.compare.real.rows import Rows
from runtime.compare.real.source import read_table
from runtime.compare.real.tokens import resolve, vocabulary_of
from runtime.model.read.text import InspectError, printable
from runtime.progress import Progress

DEFAULT_QUERIES = (" Paris", " king", " water")  # tried with a tokenizer; those that make one token are used


def default_queries(vocabulary, lengths):
    """The queries when none is given: the words of DEFAULT_QUERIES the tokenizer makes one token each, else the
    rows of median, shortest and longest length."""
    made = [vocabulary.encode(word) for word in DEFAULT_QUERIES]
    ids = [m[0] for m in made if m is not None and len(m) == 1 and 0 <= m[0] < len(lengths)]
    if ids:
        return list(dict.fromkeys(ids))
    order = np.argsort(lengths, kind="stable")
    return list(dict.fromkeys(int(t) for t in (order[len(order) // 2], order[0], order[-1])))


def _header(table, path):
    vocab, width = table.values.shape
    tie = "tied" if table.tied else "untied"
    return (f"embedding-onnx-lab compare --model {printable(path)}\ntable {printable(table.name)}: {vocab} x {width} "
            f"(vocab x width), {table.format} read as float32, {tie}; onnxruntime {ort.__version__}, onnx "
            f"{onnx.__version__}")


def _measure(config, table, lab, vocabulary, progress, say, queries):
    """(checks, lists, lengths, self-score, hub counts): the lab's checks and the figures, lists printed first;
    `queries` the ids asked for (None: the defaults)."""
    lengths = figures.norms(lab.values)
    queries = queries or default_queries(vocabulary, lengths)
    ids = list(config.ids) if config.ids else queries[:2] + queries[:1]  # a repeated id: the same row at both places
    embed.check_ids(ids, table.vocab)
    rows, k, shown = Rows(lab.values), min(config.k, table.vocab - 1), vocabulary.shown
    found, lists, wants = [], {}, {}
    for query in queries:
        progress(f"neighbours of {shown(query)} (the graphs and embed.neighbors)")
        both = {m: checks.check_neighbors(lab, rows, query, k, m, shown) for m in ("cosine", "dot")}
        found += [c for c, _, _, _ in both.values()]
        lists[query] = {m: (got, [float(s) for s in scores]) for m, (_, got, scores, _) in both.items()}
        wants[query] = {m: want for m, (_, _, _, want) in both.items()}
        say(report.side_by_side(vocabulary, lengths, query, lists[query]["cosine"], lists[query]["dot"]) + "\n")
    progress("lookups: Gather, OneHot + MatMul and the sqrt(width) scaling against embed")
    found = [checks.check_lookup(lab, rows, ids), checks.check_onehot(lab, rows, ids)] + found
    progress("a stretched row")
    found.append(checks.check_stretch(lab, rows, queries[0], k, checks.stretch_choice(rows, queries[0],
                                                                                     lists[queries[0]]["cosine"][0]),
                                      shown, wants[queries[0]]["cosine"]))
    found.append(checks.check_scaled(lab, rows, ids))
    lab.close()
    progress("self-scores: the tied head fed each token's own row")
    scores = figures.self_score(lab.values, progress)
    progress("hubs: the rows that lead sampled tokens' lists")
    counts = figures.hubs(lab, k)
    return found, lists, lengths, scores, counts


def run(config):
    """compare --model's run: 0 all checks pass, 1 any fails, 2 a model that cannot be read or a bad query."""
    progress = Progress(enabled=config.json != "-")
    out = sys.stderr if config.json == "-" else sys.stdout
    say = lambda text: (progress.done(), print(text, file=out, flush=True))
    try:
        progress(f"reading {config.model}")
        table = read_table(config.model, config.table)
        vocabulary = vocabulary_of(table)
        queries = resolve(config.queries, vocabulary, table.vocab) if config.queries else None  # refused before work
        with tempfile.TemporaryDirectory(prefix="onnx-lab-compare-model-") as folder:
            lab = Lab(table.values, folder)
            table.values = lab.values  # the decoded copy goes; the data file's map is the table from here on
            say(_header(table, config.model) + "\n")
            found, lists, lengths, scores, counts = _measure(config, table, lab, vocabulary, progress, say,
                                                                       queries)
            longest = [int(t) for t in np.argsort(-lengths, kind="stable")[:config.k]]
            found += report.table_lines(table, lengths, vocabulary, longest[:5])
            found += [report.self_score_line(vocabulary, lengths, scores), report.hubs_line(vocabulary, counts)]
            data = report.table_json(table, vocabulary, lengths, longest, lists, scores, counts)
            lab.close()
    except (InspectError, embed.UsageError, IndexError) as e:
        progress.done()
        print(f"python -m runtime.compare: error: {printable(str(e))}", file=sys.stderr)
        return 2
    progress.done()
    from runtime.compare.cli import summary  # the generated table's last line, counted the same way
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
    result = {"passed": failed == 0, "config": {**config.as_dict(), "onnxruntime": ort.__version__,
                                                "onnx": onnx.__version__},
              "checks": [asdict(c) for c in found], "table": data}
    text = json.dumps(result, indent=2) + "\n"
    if config.json == "-":
        sys.stdout.write(text)
    else:
        write_text(config.json, text)
