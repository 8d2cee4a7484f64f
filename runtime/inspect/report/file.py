"""A file's text report and --json document, from examine.inspect_model's findings: the verdict first (answer),
then a short body; the detail under --verbose."""

from runtime.inspect import answer
from runtime.model.findings import counting
from runtime.model.findings.copies import WIDENED
from runtime.model.findings.counting import human
from runtime.model.findings.vocabulary import SMALL_COPY

_DISTINCT_LISTED = 16  # more distinct pairs than this are counted in the text report, not listed


def report(info, path, out, verbose=False, in_folder=False):
    """The text report of `info` (examine.inspect_model) for the model at `path`, written to `out`: its verdict
    first, unless it is one file of a folder (`in_folder`: the folder's verdict opens the report, and what its
    sessions hold is measured together)."""
    w = lambda text: out.write(answer.line(text) + "\n")
    if not in_folder:
        for line in answer.lines(info.verdict, {v["table"]: v for v in info.vocabulary}, {}, "a session",
                                 info.onnxruntime is None):
            w(line)
        w("")
    how = f"onnxruntime {info.onnxruntime}" if info.onnxruntime else "--static: onnxruntime not run"
    w(f"{path}: {len(info.initializers)} initializers, {human(info.file_bytes)} on disk ({how})")
    if info.vocabulary and verbose:
        v = info.vocabulary[0]
        w(f"parameters: {v['parameters_counted']}, as Hugging Face counts them: {v['parameters_what']}")
    for v in info.vocabulary:
        tie = _tie(v)
        w(f"vocabulary: {'position table' if v['kind'] == 'position' else 'table'} {v['table']} {v['vocab_size']} x "
          f"{v['width']} {v['format']}, {human(v['bytes'])}, {tie}; {v['parameter_share']:.1%} of the parameters, "
          f"{v['byte_share']:.1%} of the bytes")
        for line in _details(v):
            w(f"  {line}")
        if in_folder and v["in_memory"]["defaults"]["copies"] is not None:
            w(f"  in memory: {counting.copies(v['in_memory']['defaults']['copies'])} under onnxruntime's defaults "
              "(resident bytes measured for the folder's files together, below)")
        else:
            w(f"  in memory: {held_line(v['in_memory'], info.measure_error, verbose)}")
    if not info.vocabulary:
        w("vocabulary: no table (no Gather, GatherBlockQuantized or OneHot + MatMul reads rows from an initializer)")
    if verbose:
        _initializers(info, w)
    _readers(info, w, verbose)
    _pairs(info, w, verbose)
    _runtime_copies(info, w, verbose)
    shared = info.branch_weights
    if shared:
        graphs = sorted({g for b in shared for g in b["graphs"]})
        w(f"weights {len(graphs)} graphs share: {len(shared)} matmul weights, {human(sum(b['bytes'] for b in shared))}, "
          f"read in {', '.join(graphs)}; under onnxruntime's defaults each graph's kernels prepack their own copy "
          "(held once per graph; a --retie that rewrites this file reads them in place where its proof holds)")
    if not in_folder:
        w(answer.FOOTER)


def _initializers(info, w):
    """The initializer table (--verbose): name, type, shape, elements and exact bytes of each."""
    names = max([32] + [len(i["name"]) for i in info.initializers])
    shapes = max([16] + [len(str(i["shape"])) for i in info.initializers])
    w(f"  {'name':<{names}} {'dtype':<8} {'shape':<{shapes}} {'elements':>12} {'bytes':>12}")
    for i in info.initializers:
        w(f"  {i['name']:<{names}} {i['dtype']:<8} {str(i['shape']):<{shapes}} {i['elements']:>12} {i['bytes']:>12}")


def _readers(info, w, verbose):
    """What reads each table and each logits head, and how many other matmul weights there are: under --verbose,
    or where a logits head is not the head a vocabulary line names (by default each is said once, there)."""
    logits = [h for h in info.heads if h.scores]
    named = {v["head"] for v in info.vocabulary}
    if not verbose and all(h.initializer in named for h in logits):
        return
    tables = [f"{t.initializer} ({t.node.op_type}{_views(t)})" for t in info.tables]
    w("tables (read by Gather/GatherBlockQuantized/OneHot+MatMul): " + (", ".join(tables) or "none"))
    others = [h for h in info.heads if not h.scores]
    ops = sorted({h.node.op_type for h in others})
    w("logits heads (matmul weights whose products are graph outputs): "
      + (", ".join(f"{h.initializer} ({h.node.op_type}{_views(h)})" for h in logits) or "none")
      + (f"; {len(others)} other matmul weight{'s' if len(others) != 1 else ''} ({', '.join(ops)})" if others else ""))


def _said(info):
    """The (table, head, relation) a vocabulary line already says: its table and the head that holds its values."""
    return {(v["table"], v["head"], v["tie_relation"]) for v in info.vocabulary if v["tied"]}


def _pairs(info, w, verbose):
    """One line per table/head pair that holds one table's values twice and that no vocabulary line has said, a
    stored head read by several branches once; the distinct pairs counted (listed under --verbose)."""
    distinct = [p for p in info.pairs if p.relation == "distinct"]
    related = [p for p in info.pairs if p.relation != "distinct"]
    said = set() if verbose else _said(info)
    listed = [p for p in related if verbose or (p.table != p.head  # one tensor: the vocabulary line says so
                                                 and (p.table, p.head, p.relation) not in said)]
    listed += distinct if verbose and len(distinct) <= _DISTINCT_LISTED else []
    if len(related) > _DISTINCT_LISTED:  # many equal tables: a line per set of them, not one per pair
        listed = [p for p in listed if p.relation == "distinct"]
        for line in _many_related(related):
            w(line)
    readers = {}
    for p in listed:
        readers.setdefault((p.table, p.table_graph, p.head, p.relation), []).append(p)
    for (_, _, _, relation), found in readers.items():
        p = found[0]
        unit = "their mean scale" if p.both_quantized else "the quantized one's scale"
        gap = (f" (largest difference {p.max_error_in_scales:.3g} of {unit})"
               if relation == "quantized_copy" else "")
        table = p.table + (f" (in {p.table_graph})" if p.table_graph != "main" else "")
        graphs = [q.head_graph for q in found if q.head_graph != "main"]
        head = p.head + (f" (read in {', '.join(graphs)})" if graphs else "")
        wasted = f", {human(p.wasted_bytes)} wasted in the file" if relation != "distinct" else ""
        w(f"pair {table} / {head}: {relation}{gap}{wasted}")
    if distinct and not (verbose and len(distinct) <= _DISTINCT_LISTED):
        w(f"{len(distinct)} table/head pair{'s' if len(distinct) != 1 else ''} of matching shape distinct "
          f"({'each listed under --json' if verbose else 'listed under --verbose'})")
    if not info.pairs:
        w("no table/head pair of matching shape")


def _many_related(related):
    """One line per set of tables that the same heads hold the values of (each table/head pair under --json)."""
    heads = {}
    for p in related:
        heads.setdefault(p.table, {})[p.head] = p
    sets = {}
    for table, found in heads.items():
        sets.setdefault(frozenset(found), []).append(table)
    for names, tables in sets.items():
        found = [heads[t][h] for t in tables for h in names]
        kinds = {}
        for p in found:
            kinds[p.relation] = kinds.get(p.relation, 0) + 1
        table, head = min(tables), min(names)
        yield (f"{len(tables)} table(s) ({table}{', ...' if len(tables) > 1 else ''}) and {len(names)} head(s) "
               f"({head}{', ...' if len(names) > 1 else ''}) hold the same values:")
        yield (f"  {len(found)} pairs, " + ", ".join(f"{n} {k}" for k, n in kinds.items())
               + f"; {human(sum(heads[tables[0]][h].wasted_bytes for h in names))} wasted in the file")


def _runtime_copies(info, w, verbose):
    """The lines on what onnxruntime adds: each runtime copy of a table (folded or prepacked); the small ones
    counted under --verbose."""
    if info.runtime_copies is None:
        w("runtime copies: not looked for (--static)")
        return
    small = [c for c in info.runtime_copies if c["bytes"] < SMALL_COPY and "copy_of" not in c]
    others = [c for c in info.runtime_copies if c not in small and "copy_of" not in c]  # no table's values
    for line in _table_copies([c for c in info.runtime_copies if "copy_of" in c]):
        w(line)
    for c in others if verbose else []:
        where = f" in {c['graph']}" if "graph" in c else ""
        w(f"runtime copy {c['name']}{where} {c['shape']}: {human(c['bytes'])} added by onnxruntime's optimizations")
    if others and not verbose:  # a 30-layer float16 model's 212 widened weights: one line, not 212
        widened = all(c["name"].startswith(WIDENED) for c in others)
        w(f"runtime copies of {len(others)} other weights, {human(sum(c['bytes'] for c in others))}: "
          f"{'their float32 widenings' if widened else 'folded by its optimizations'} (--verbose lists them)")
    if small and verbose:
        w(f"runtime copies under {SMALL_COPY} bytes: {len(small)} (folded constants), "
          f"{sum(c['bytes'] for c in small)} bytes in all")
    if not info.runtime_copies:
        w("runtime copies: none (onnxruntime's optimized model adds no initializer)")


def _table_copies(copies):
    """One line per weight whose values onnxruntime holds again (runtime copies with `copy_of`): each copy its
    optimizations folded (its name and how it differs: --json has its shape) with what a kernel prepacked of it,
    and each copy a kernel prepacked of the weight itself."""
    folded = {c["name"]: c for c in copies if c.get("view") != "prepacked"}
    packed = {}
    for c in copies:
        if c.get("view") == "prepacked":
            packed.setdefault(c["copy_of"], []).append(c)
    by = lambda c: (f"prepacked by {c['kernel']} node {c['node']!r}" if c["node"] else
                    f"prepacked by a {c['kernel']} node") + f", {human(c['bytes'])}"
    groups = {}
    for c in copies:
        weight = c["copy_of"] if c["copy_of"] not in folded else folded[c["copy_of"]]["copy_of"]
        if c.get("view") != "prepacked":
            groups.setdefault((weight, c.get("graph")), []).append(", ".join(
                [f"{c['name']} {'as stored' if c['view'] == 'same' else c['view']}, {human(c['bytes'])}"] +
                [by(p) for p in packed.get(c["name"], [])]))
        elif c["copy_of"] not in folded:
            groups.setdefault((weight, c.get("graph")), []).insert(0, by(c))
    for (weight, graph), said in groups.items():
        yield f"runtime copies of {weight}{f' in {graph}' if graph else ''}: {'; '.join(said)}"


def _details(v):
    """The vocabulary entry's other facts, one line each: padding, the rows' scale, a quantized copy as head."""
    if v["padded_width"]:
        yield f"codes padded to {v['padded_width']} columns (whole blocks); a Slice cuts the rows back to {v['width']}"
    if v["row_scale"] is not None:
        what = (f"sqrt({v['width']}): the sqrt(width) scaling" if v["row_scale_is_sqrt_width"] else
                f"not sqrt({v['width']}) = {v['width'] ** 0.5:.6g}")
        yield f"looked-up rows multiplied by {v['row_scale']:.6g}, {what}"
    if v["quantized_head"]:
        q = v["quantized_head"]
        if q["wasted_bytes"]:  # both quantized, each from the same floats
            yield (f"head {q['head']} holds these values quantized a second way (largest difference "
                   f"{q['max_error_in_scales']:.3g} of their mean scale): a copy up to rounding, not a tie; "
                   f"{q['wasted_bytes']} bytes")
        else:
            yield (f"head {q['head']} holds these values quantized (largest difference {q['max_error_in_scales']:.3g} "
                   "of its scale): a copy up to rounding, not a tie")


def _tie(v):
    """'tied to head H' only where table and head are one tensor held once; a copy is called what it is."""
    if not v["tied"]:
        return "not tied"
    if v["tie_relation"] != "shared":
        return f"not one tensor: head {v['head']} holds a {v['tie_relation'].replace('_', ' ')} of it"
    held = v["tables_in_memory"]
    if held is not None and held > 1:  # the copies held: the in-memory line below
        return f"one tensor with head {v['head']} on disk"
    return f"tied to head {v['head']}"


def held_line(entry, error, verbose, measured="resident after a run:"):
    """The copies a session holds under the defaults (a vocabulary entry's `in_memory`) and what one run adds
    (`measured` names the figure), in one line; with `verbose`, its anonymous and file-backed parts and the same
    with prepacking off; `error` why it was not measured."""
    def figures(held):
        if held["resident_bytes"] is None:
            return f"not measured: {error}" if error else "not measured"
        ratio = ("too small a table for a ratio" if held["times_table"] is None else
                 f"{held['times_table']:.2f}x the table beyond the other weights")
        kept = held.get("kept_bytes") or 0
        parts = (f", {held['anonymous_bytes'] / 2**20:.1f} anonymous and {held['file_bytes'] / 2**20:.1f} "
                 "file-backed" + (f", and {kept / 2**20:.1f} more the C library kept of what onnxruntime freed "
                                  "(malloc_trim returned it)" if kept >= 2**20 else "") if verbose else "")
        return f"{measured} {held['resident_bytes'] / 2**20:+.1f} MiB{parts}: {ratio}"
    defaults, off = entry["defaults"], entry["no_prepacking"]
    if defaults["copies"] is None:
        return "not counted (--static: onnxruntime not run)"
    line = f"{counting.copies(defaults['copies'])} under onnxruntime's defaults ({figures(defaults)})"
    if verbose:
        return line + f"; {counting.copies(off['copies'])} with {counting.NO_PREPACKING} ({figures(off)})"
    return line + (f"; {off['copies']} with {counting.NO_PREPACKING}" if off["copies"] != defaults["copies"] else "")


def _views(entry):
    where = f", in {entry.graph}" if entry.graph != "main" else ""
    return (f", through {', '.join(entry.views)}" if entry.views else "") + where


def as_json(info, path=None, verdict=True):
    """What --json prints of `info` (for the model at `path`: its `model` key); `verdict` False for a folder's file
    (the folder's verdict is its own)."""
    return {**({"model": path} if path is not None else {}),
            **({"verdict": info.verdict} if verdict else {}), "onnxruntime": info.onnxruntime,
            "file_bytes": info.file_bytes, "initializers": info.initializers, "vocabulary": info.vocabulary,
            "pairs": [p.as_json() for p in info.pairs],
            "runtime_copies": info.runtime_copies, "branch_weights": info.branch_weights,
            "prefill": info.prefill, "prepacked_unrecorded": info.unrecorded and info.unrecorded._asdict()}
