"""--retie: make every duplicated head read its table in a form onnxruntime keeps as one, prove it, then write."""
import os

from onnx import TensorProto, helper

import graphs
from runtime.inspect import isolated, memory, sidecars
from runtime.inspect.feeds import describe
from runtime.inspect.reading import InspectError, load
from runtime.inspect.retie_edits import const, drop_dead, shell, unique_name, view_of
from runtime.inspect.retie_packed import gather_head_codes, gather_packed_in_place, packed_duplicate, packed_shared
from runtime.resident import copies_held, prepacked_copies
from runtime.inspect.relations import copy_key, runtime_copies, stored_as_table
from runtime.inspect.walk import lookup_ids


def remedy(pair):
    """What --retie does with a table/head pair, decided here and nowhere else: (how, why). `how` is "packed_shared",
    "packed_duplicate" or "view" (the head, and a OneHot product's lookup, read the one table through graphs.tie's
    run-time view; a head becomes a Gemm(transB=1) on it), or None when the pair is left as it is; `why` then says
    why in one line where the pair holds one table's values twice (None where there is nothing to say)."""
    table, head, relation = pair["table_entry"], pair["head_entry"], pair["relation"]
    if relation == "distinct":
        return None, None
    inside = [g for g in (table["graph"], head["graph"]) if g != "main"]
    if any(not _in_branches(g) for g in inside):
        return None, (f"read inside a Loop or Scan body ({inside[0]}): found and counted, but --retie rewrites the "
                      "main graph and If branches only")
    if relation == "quantized_copy":
        return None, ("a quantized copy, not a tie: its values differ from the table's by rounding, so neither can "
                      "read the other's without changing the outputs")
    if (packed_shared(pair) or packed_duplicate(pair)) and inside:
        return None, f"an int4 tie inside an If branch ({inside[0]}): found and counted, not rewritten there yet"
    if packed_shared(pair):
        return "packed_shared", None
    if packed_duplicate(pair):
        return "packed_duplicate", None
    views = table["views"] + head["views"]
    if table["format"] != "float32" or head["format"] != "float32":
        return None, (f"a {table['format']} table read through {', '.join(views) or 'no view'} by "
                      f"{table['node'].op_type}: left as it is (--retie rewrites float32 tables, and onnxruntime's "
                      "int4 block layouts)")
    if "Reshape" in views:
        return None, (f"read through a Reshape that is not the table's own shape ({', '.join(views)}): left as it is "
                      "(a rewrite would have to undo it)")
    if relation == "shared" and not pair["via_transpose"] and "View" in head["views"] and (
            table["node"].op_type == "Gather" or "View" in table["views"]):
        return None, None  # already read through a run-time view: one table in memory
    return "view", None


def _in_branches(path):
    """Whether a graph path (reading.graph_paths) runs through If branches only, each a graph run once as a whole
    (a Loop or Scan body runs once per iteration: a proof would have to follow its state)."""
    return all(step.endswith((".then_branch", ".else_branch")) for step in path.split("/")[1:])


def rewrite(model, pairs):
    """Rewrite `model.proto` in place as remedy() says for each pair, so that each table and its head read one
    tensor stored [vocab, width] in a form onnxruntime keeps as one: a duplicated head, a head that prepacks the
    table it shares, or one reading it through a Transpose (which onnxruntime folds into a copy), becomes
    Gemm(transB=1) on the table's run-time view (a OneHot product's lookup reads that view too), and a table
    stored [width, vocab] (onnxruntime-genai's shared embeddings) is stored once the other way round.
    Returns ([(head output, hidden input, table as the original stores it, whether transposed there, the table's
    name now)], {name: array} of the data of every external or new initializer, views on the model's files that
    graphs.save writes in chunks: no tensor is loaded whole)."""
    graph = model.proto.graph
    rewritten, done = [], set()
    sources = {t.name: model.tensors[t.name].raw() for t in graph.initializer if t.data_location == TensorProto.EXTERNAL}
    for p in pairs:
        table, head = p["table_entry"], p["head_entry"]
        how, _ = remedy(p)
        if how == "packed_shared" and id(table["node"]) not in done:
            done.add(id(table["node"]))
            if gather_packed_in_place(graph, model, table):
                rewritten.append((None, None, table["initializer"], False, table["initializer"]))
        elif how == "packed_duplicate" and id(table["node"]) not in done:
            done.add(id(table["node"]))
            if gather_head_codes(graph, model, table, head):
                rewritten.append((None, None, table["initializer"], False, head["initializer"]))
        elif how == "view" and id(head["node"]) not in done:
            done.add(id(head["node"]))
            name, flipped = table["initializer"], table["flips"] % 2 == 1
            if flipped:  # stored [width, vocab]: store it once as [vocab, width] and look rows up directly
                rows = unique_name(graph, model, name + "_rows")
                sources[rows] = shell(graph, rows, model.tensors[name].values().T)
                table["node"].input[0] = rows
                name = rows
            if table["node"].op_type == "MatMul" and id(table["node"]) not in done:  # one_hot(ids) @ table
                done.add(id(table["node"]))
                table["node"].input[1] = view_of(table["body"], model, table["node"], name, lookup_ids(table),
                                               [table["vocab"], table["width"]])
            # in the head's own graph (an If branch reads the table and the view's constants from outside)
            rewritten.append(_gemm_head(head["body"], model, head["node"], name, table["vocab"], table["width"])
                             + (table["initializer"], flipped, name))
    drop_dead(graph)
    kept = {t.name for t in graph.initializer}
    return rewritten, {name: array for name, array in sources.items() if name in kept}


def _gemm_head(graph, model, node, table, vocab, width):
    """Make head `node` a Gemm(transB=1) on `table` (a FusedMatMul stays one, transB=1), read through
    graphs.tie's run-time view so that onnxruntime's defaults do not prepack a second copy of it; (output,
    hidden input)."""
    hidden, output = node.input[0], node.output[0]
    prefix = unique_name(graph, model, "retie_head") + "_"
    table = view_of(graph, model, node, table, hidden, [vocab, width])
    if node.op_type in ("Gemm", "FusedMatMul"):
        kept = [a for a in node.attribute if a.name != "transB"]  # alpha, beta, transA stay
        del node.attribute[:]
        node.attribute.extend(kept)
        node.input[1] = table  # B becomes the table itself, read transposed in place
        node.attribute.append(helper.make_attribute("transB", 1))
        return output, hidden
    at = list(graph.node).index(node)
    new = [
        helper.make_node("Shape", [hidden], [prefix + "hidden_shape"], name=prefix + "shape"),
        helper.make_node("Slice", [prefix + "hidden_shape", const(model.proto.graph, prefix + "zero", [0]),
                                   const(model.proto.graph, prefix + "minus_one", [-1])], [prefix + "lead_dims"],
                         name=prefix + "lead_dims"),
        helper.make_node("Concat", [prefix + "lead_dims", const(model.proto.graph, prefix + "vocab", [vocab])],
                         [prefix + "logits_shape"], name=prefix + "logits_shape", axis=0),
        helper.make_node("Reshape", [hidden, const(model.proto.graph, prefix + "rows_shape", [-1, width])], [prefix + "rows"],
                         name=prefix + "flatten"),
        helper.make_node("Gemm", [prefix + "rows", table], [prefix + "logits_rows"], name=prefix + "tied_head",
                         doc_string=f"tied head: hidden @ {table}^T, read in place (retied by runtime.inspect)",
                         transB=1),
        helper.make_node("Reshape", [prefix + "logits_rows", prefix + "logits_shape"], [output],
                         name=prefix + "unflatten"),
    ]
    graph.node.remove(node)
    for offset, n in enumerate(new):
        graph.node.insert(at + offset, n)
    return output, hidden


def borrow(model, sources, head, owner, table):
    """Point `head` (an entry of `model`, a file that holds no lookup of the table) at `table`, an initializer of
    another file's model `owner` with the same values: the table is declared in `model` too (its data, in `sources`,
    read from `owner`'s file; saved together with `owner` it is stored once, graphs.together) and the head becomes a
    Gemm(transB=1) on its run-time view, as rewrite() makes a head in one file; the head's own copy is dropped.
    The rewritten entry, as rewrite() lists them."""
    graph = model.proto.graph
    name = unique_name(graph, model, table["initializer"])
    sources[name] = shell(graph, name, owner.tensors[table["initializer"]].values())
    entry = _gemm_head(head["body"], model, head["node"], name, table["vocab"], table["width"])
    drop_dead(graph)
    sources.pop(head["initializer"], None)
    return entry + (head["initializer"], not stored_as_table(head), name)


def planned(model, found, say):
    """Rewrite `model` as remedy() says (rewrite()) and say each tie left as it is: (rewritten, sources); an
    InspectError for an opset the rewrite cannot use."""
    if any(op.domain in ("", "ai.onnx") and op.version < 13 for op in model.proto.opset_import):
        raise InspectError(f"{model.path}: opset below 13; --retie rewrites with opset-13 Slice and Reshape")
    rewritten, sources = rewrite(model, found["pairs"])
    for p in found["pairs"]:
        how, why = remedy(p)
        if how is None and why is not None:
            say(f"retie: {p['table']} / {p['head']} ({p['relation']}): {why}\n")
    return rewritten, sources


def proven(model, found, rewritten, sources, folder, limits, upstream=()):
    """Stage the rewritten model in `folder`, prove it (isolated) and count the copies a session would hold under
    onnxruntime's defaults: (staged path, {table now: copies held}, failures: empty when proven). InspectError
    when the original cannot be run on the proof's feeds (nothing about the retie is known). `upstream`: the inputs
    other files of a folder make (proof._fed_from)."""
    staged = os.path.join(folder, "retied.onnx")
    limits.progress("writing the retied model to the scratch folder, to prove it")
    graphs.save(model.proto, staged, check=False, sources=sources)  # checked, like everything else, in the child
    job = {"kind": "prove", "before": os.path.abspath(model.path), "checked": model.checked, "after": staged,
           "rewritten": rewritten, "rows": found["rows"], "folder": folder, "shape": found["shape"],
           "upstream": list(upstream)}
    try:
        answer = isolated.call(job, "proving the retied model", limits, model.file_bytes)
        if "original" in answer:  # nothing about the retie is known: say so, and blame nothing
            raise InspectError(f"{model.path} cannot be proven on this machine, nothing written: "
                               f"{answer['original']} (--proof-past N sets the past length)")
        failures = answer["failures"]
        optimized = os.path.join(folder, "retied.optimized.onnx")
        isolated.call({"kind": "optimize", "model": staged, "out": optimized, "folder": folder},
                      "optimizing the retied model", limits, model.file_bytes)
    except isolated.StepFailed as e:  # onnx or onnxruntime refusing the rewritten model: write nothing
        return staged, {}, [f"failed, nothing written: {e}"]
    retied, retied_optimized = load(staged), load(optimized, folder)
    copies = runtime_copies(retied, retied_optimized, sorted({final for *_, final in rewritten}))
    prepacked = prepacked_copies(retied_optimized.proto)
    before = {v["table"]: v["tables_in_memory"] for v in found["vocabulary"]}
    held = {}
    for table, original in {final: original for _, _, original, _, final in rewritten}.items():
        extra = [copy_key(c) for c in copies if c.get("copy_of") == table and c["bytes"] >= retied.tensors[table].nbytes]
        if extra:
            failures.append(f"onnxruntime still copies {table} at run time: {extra}")
        held[table] = copies_held([table] + extra, retied_optimized.proto, prepacked, prepacking=True)
        float_table = retied.tensors[table].data_type == TensorProto.FLOAT
        if held[table] > (1 if float_table else before.get(original, 1)):
            failures.append(f"under onnxruntime's default SessionOptions a session would hold {held[table]} copies "
                            f"of {table}")
    return staged, held, failures


def retie(model, found, out_path, folder, limits, say):
    """Rewrite, prove (isolated), and only then write OUT. 0 written or nothing to do, 1 not proven."""
    rewritten, sources = planned(model, found, say)
    if not rewritten:
        say("retie: nothing to do: no table is held twice in a form --retie rewrites (any left is named above)\n")
        return 0
    staged, held, failures = proven(model, found, rewritten, sources, folder, limits)
    if failures:
        say(f"retie: {failures[0]}\n" if failures[0].startswith("failed") else
            f"retie: not proven, nothing written: {failures[0]}\n")
        return 1
    measured = memory.measure({"model": staged}, found["rows"], found["shape"], folder, limits, model.file_bytes)
    limits.progress(f"writing {out_path}")
    written = graphs.save(model.proto, out_path, check=False, sources=sources)  # the model the child checked
    limits.committing()  # OUT is in place: what is left (these lines, the sidecars) is not cut off by the deadline
    size = sum(os.path.getsize(p) for p in written)
    say(rewritten_line(rewritten, model, found["shape"]))
    was = {v["table"]: v for v in found["vocabulary"]}
    for table, original in {final: original for _, _, original, _, final in rewritten}.items():
        say(gained_line(table, held[table], was.get(original), measured.get("defaults")))
    saved = model.file_bytes - size
    say(f"retie: wrote {out_path}: {model.file_bytes} -> {size} bytes on disk "
        f"({f'saved {saved}' if saved >= 0 else f'{-saved} bytes more'})\n")
    for line in sidecars.copy_beside(model.path, out_path):
        say(f"retie: {line}\n")
    return 0


def rewritten_line(rewritten, model, shape, where="", fed=()):
    """The line that says what a proven retie of `model` rewrote and on which feeds (feeds.plan's `shape`; `fed`:
    the inputs another file made, retie_folder.upstream); `where`: the file's name and ': ', in a folder."""
    kept = ", ".join(sorted({final for *_, final in rewritten}))
    heads = sum(hidden is not None for _, hidden, *_ in rewritten)
    lookups = len(rewritten) - heads
    changed = [f"{heads} head{'s' if heads != 1 else ''} now a Gemm on its run-time view"] if heads else []
    changed += [f"{lookups} lookup{'s' if lookups != 1 else ''} now reading the head's codes"] if lookups else []
    branches = any(v.name == "use_cache_branch" for v in model.proto.graph.input)
    feeds = describe(shape) + (", both branches of use_cache_branch" if branches else "") + "".join(
        f", {f['input']} from {os.path.basename(f['checked']['path'])}" for f in fed)
    return (f"retie: {where}{kept} is now the one copy ({'; '.join(changed)}); proven on decoder feeds ({feeds}): "
            "heads within 2 gamma_w sum|a b|, every other output bit for bit\n")


def gained_line(table, copies, was, figures):
    """The line that says what a retie gained in a session under onnxruntime's defaults: the copies of `table` it
    holds and, where measured (memory.measure's `figures`, the vocabulary entry `was` before), what it adds after a
    run and at its peak, against the original's; and why, where the copies stay as they were."""
    def mib(entry, key):
        value = None if entry is None else entry.get(key)
        return "?" if value is None else f"+{value / 2**20:.1f} MiB"

    before = None if was is None else was["in_memory"]["defaults"]
    counted = "?" if was is None else was["tables_in_memory"]
    line = (f"retie: under onnxruntime's default SessionOptions a session holds {copies} cop"
            f"{'y' if copies == 1 else 'ies'} of {table} (was {counted})")
    if figures is not None:
        line += (f": {mib(figures, 'resident_bytes')} resident after a run (was {mib(before, 'resident_bytes')}), "
                 f"at most {mib(figures, 'peak_bytes')} on the way (was {mib(before, 'peak_bytes')})")
    if copies == counted and copies > 1:
        line += "; the head's kernel prepacks its own copy of the codes, with or without the retie"
    return line + "\n"
