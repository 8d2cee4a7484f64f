"""The rewrite --retie makes: each duplicated head read from its table in a form onnxruntime keeps as one."""
from onnx import helper

from runtime.model.graph.ops import TRANSPOSING
from runtime.model.graph.quantized import attribute
from runtime.model.graph.walk import lookup_ids
from runtime.model.read.text import InspectError
from runtime.inspect.retie import headlookup
from runtime.inspect.retie.edits import const, drop_dead, external_sources, shell, unique_name, view_of
from runtime.inspect.retie.packed import gather_head_codes, gather_packed_in_place
from runtime.inspect.retie import int8share
from runtime.inspect.retie.rules import LOOKUP_FROM_HEAD, SHARED_INT8, remedy
from runtime.inspect.sandbox.jobs import Rewritten


def rewrite(model, pairs, lossy=None):
    """Rewrite `model.proto` in place as remedy() says for each pair, so that each table and its head read one
    tensor stored [vocab, width] in a form onnxruntime keeps as one: a duplicated head, a head that prepacks the
    table it shares, or one reading it through a Transpose (which onnxruntime folds into a copy), becomes
    Gemm(transB=1) on the table's run-time view (a OneHot product's lookup reads that view too), and a table
    stored [width, vocab] (onnxruntime-genai's shared embeddings) is stored once the other way round; with
    `lossy` (a rules.Lossy), a float table's Gather reads its MatMulNBits head's codes (retie.headlookup), after
    --shared-int8 has made those int8 codes of the table (retie.int8share); in standard ops where lossy.decoded.
    Returns ([sandbox.jobs.Rewritten], {name: array} of the data of every external or new initializer, views on the model's files that
    graphs.save writes in chunks: no table is loaded whole; external Constant values and subgraph initializers are
    read into the model, edits.inline_nested)."""
    graph = model.proto.graph
    rewritten, done, lookups = [], set(), []
    sources = external_sources(model)
    for p in pairs:
        table, head = p.table_entry, p.head_entry
        how, _ = remedy(p, lossy)
        if how in (LOOKUP_FROM_HEAD, SHARED_INT8) and id(table.node) not in done:
            done.add(id(table.node))
            if how == SHARED_INT8:
                head = int8share.share_int8(graph, model, table, head, sources)
            make = headlookup.decoded_lookup if lossy.decoded else headlookup.lookup_from_head
            found = make(graph, model, table, head, sources)
            found = found and found._replace(requantized=how == SHARED_INT8)
            if found:
                lookups.append(found)
                rewritten.append(Rewritten(None, None, table.initializer, found.transposed, head.initializer))
        elif how == "packed_shared" and id(table.node) not in done:
            done.add(id(table.node))
            if gather_packed_in_place(graph, model, table):
                rewritten.append(Rewritten(None, None, table.initializer, False, table.initializer))
        elif how == "packed_duplicate" and id(table.node) not in done:
            done.add(id(table.node))
            if gather_head_codes(graph, model, table, head):
                rewritten.append(Rewritten(None, None, table.initializer, False, head.initializer))
        elif how == "view" and id(head.node) not in done:
            done.add(id(head.node))
            name, flipped = table.initializer, table.flips % 2 == 1
            if flipped:  # stored [width, vocab]: store it once as [vocab, width] and look rows up directly
                rows = unique_name(model, name + "_rows")
                sources[rows] = shell(graph, rows, model.tensors[name].values().T)
                table.node.input[0] = rows
                name = rows
            if table.node.op_type == "MatMul" and id(table.node) not in done:  # one_hot(ids) @ table
                done.add(id(table.node))
                table.node.input[1] = view_of(table.body, model, table.node, name, lookup_ids(table),
                                               [table.vocab, table.width])
            # in the head's own graph (an If branch reads the table and the view's constants from outside)
            rewritten.append(Rewritten(*_gemm_head(head.body, model, head.node, name,
                                                   (table.vocab, table.width), cast_to(head)),
                                       table.initializer, flipped, name))
    drop_dead(graph)
    kept = {t.name for t in graph.initializer}
    return rewritten, {name: array for name, array in sources.items() if name in kept}, lookups


def cast_to(head):
    """The type a head's kernel reads its weight as where a Cast lies between the stored weight and the head (the
    nearest one's `to`: the lab's float16 / bfloat16 tables decoded to float32 for a float32 head), else None."""
    name, producer = head.node.input[1], head.producer
    node = producer.get(name)
    while node is not None and node.op_type != "Cast" and node.input:  # views only, up to the initializer
        node = producer.get(node.input[0])
    return None if node is None or node.op_type != "Cast" else attribute(node, "to")


def _gemm_head(graph, model, node, table, dims, cast=None):
    """Make head `node` a Gemm(transB=1) on `table` ([vocab, width] `dims`; a FusedMatMul stays one, transB=1),
    read through graphs.tie's run-time view so that onnxruntime's defaults do not prepack a second copy of it;
    `cast`: the type the head read its weight as (cast_to), a Cast of the view then made at each run (not folded
    at load into a second table, not prepacked); (output, hidden input)."""
    (vocab, width), hidden, output = dims, node.input[0], node.output[0]
    prefix = unique_name(model, "retie_head") + "_"
    named = lambda k, of=table: f"{of}.{prefix}{k}"  # a constant, named after the table it serves
    table = view_of(graph, model, node, table, hidden, [vocab, width])
    if cast is not None:  # the head multiplied a Cast of its weight: it still does, of the one table's view
        graph.node.insert(list(graph.node).index(node), helper.make_node(
            "Cast", [table], [prefix + "cast"], name=prefix + "cast", to=cast,
            doc_string="the table as the head multiplies it, made at each run (retied by runtime.inspect)"))
        table = prefix + "cast"
    if node.op_type in TRANSPOSING:
        kept = [a for a in node.attribute if a.name != "transB"]  # alpha, beta, transA stay
        del node.attribute[:]
        node.attribute.extend(kept)
        node.input[1] = table  # B becomes the table itself, read transposed in place
        node.attribute.append(helper.make_attribute("transB", 1))
        return output, hidden
    at = list(graph.node).index(node)
    new = [
        helper.make_node("Shape", [hidden], [prefix + "hidden_shape"], name=prefix + "shape"),
        helper.make_node("Slice", [prefix + "hidden_shape", const(model.proto.graph, named("zero"), [0]),
                                   const(model.proto.graph, named("minus_one"), [-1])], [prefix + "lead_dims"],
                         name=prefix + "lead_dims"),
        helper.make_node("Concat", [prefix + "lead_dims", const(model.proto.graph, named("vocab"), [vocab])],
                         [prefix + "logits_shape"], name=prefix + "logits_shape", axis=0),
        helper.make_node("Reshape", [hidden, const(model.proto.graph, named("rows_shape"), [-1, width])], [prefix + "rows"],
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
    name = unique_name(model, table.initializer)
    sources[name] = shell(graph, name, owner.tensors[table.initializer].values())
    entry = _gemm_head(head.body, model, head.node, name, (table.vocab, table.width), cast_to(head))
    drop_dead(graph)
    sources.pop(head.initializer, None)
    return Rewritten(*entry, head.initializer, not head.rows_are_tokens, name)


def planned(model, found, say, lossy=None):
    """Rewrite `model` as remedy() says (rewrite()) and say each tie left as it is: (rewritten, sources, lookups:
    [headlookup.Lookup]); an InspectError for an opset the rewrite cannot use."""
    if any(op.domain in ("", "ai.onnx") and op.version < 13 for op in model.proto.opset_import):
        raise InspectError(f"{model.path}: opset below 13; --retie rewrites with opset-13 Slice and Reshape")
    casts = {p.head: cast_to(p.head_entry) for p in found.pairs if remedy(p)[0] == "view"}
    rewritten, sources, lookups = rewrite(model, found.pairs, lossy)
    for p in found.pairs:
        how, why = remedy(p, lossy)
        if how is None and why is not None:
            say(f"retie: {p.table} / {p.head} ({p.relation}): {why}\n")
    for head, cast in casts.items():
        if cast is not None:  # the memory a run then takes is measured with the rest, not counted as a copy
            say(f"retie: {head}: its head multiplied a Cast of it to {helper.tensor_dtype_to_np_dtype(cast)}, folded "
                "into a second table at load; that Cast of the one table now runs at each call (a table of that "
                "type for the call)\n")
    return rewritten, sources, lookups
