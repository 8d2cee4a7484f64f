"""One builder per graph: each returns a checked onnx.ModelProto that reads well in Netron.

A builder takes its table as float32 rows or an array, or as a graphs.precision.Stored (a table quantized once,
for several graphs in one format to share)."""
import math

import numpy as np
from onnx import TensorProto, helper

import embed
from graphs import precision
from graphs.storage import check
from graphs.tie import unfolded_view

OPSET = 21  # opset 21 is what onnxruntime 1.32 runs natively; com.microsoft ops (the heads, int4 rows) are its own
IR_VERSION = 10
FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def as_table(table, name="table"):
    """A C-contiguous float32 [vocab, width] array from a list of rows or an array (float32 arrays are not copied)."""
    if isinstance(table, np.ndarray):
        if table.ndim != 2 or 0 in table.shape:
            raise ValueError(f"{name} must be a non-empty 2-D array, got shape {table.shape}")
        if table.dtype != np.float32:
            raise TypeError(f"{name} must be float32, got {table.dtype}")
        return np.ascontiguousarray(table)
    embed.shape(table)  # the reference's checks: non-empty, rectangular
    return np.asarray(table, dtype=np.float32)


def _value(name, elem_type, dims):
    return helper.make_tensor_value_info(name, elem_type, dims)


def _node(op, inputs, outputs, name, doc, **attrs):
    return helper.make_node(op, inputs, outputs, name=name, doc_string=doc, **attrs)


def _weight(array, name, doc):
    """(name, data, dims, type, doc): the model is given its tensors in place (see _model), so tables past 2 GiB
    fit."""
    return name, array, list(array.shape), helper.np_dtype_to_tensor_dtype(array.dtype), doc


def _const(values, name, dtype, doc):
    return _weight(np.asarray(values, dtype=dtype), name, doc)


def _model(graph, weights, layout, tied=False, tables=1):
    """Assemble, tag and check a model of `graph` (make_graph's, no initializers) and `weights` (_weight's), its
    table laid out as `layout`; `tables` is how many vocab x width tensors it holds.

    make_graph/make_model get the nodes and values only; the initializers are filled in afterwards, in place,
    since those helpers copy what they are given by serializing it, which fails for a tensor of 2 GiB or more.
    """
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="embedding-onnx-lab", doc_string=graph.doc_string)
    model.ir_version = IR_VERSION
    if any(node.domain == "com.microsoft" for node in graph.node):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    lengths = {}
    for name, array, dims, elem_type, weight_doc in weights:
        tensor = model.graph.initializer.add()
        tensor.name, tensor.doc_string, tensor.data_type = name, weight_doc, elem_type
        tensor.dims.extend(dims)
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        tensor.raw_data, lengths[name] = data, len(data)
        del data  # the protobuf holds its own copy
    vocab, width = layout.vocab, layout.width
    helper.set_model_props(model, {
        "graph": graph.name,
        "vocab_size": str(vocab),
        "width": str(width),
        "tied": "true" if tied else "false",
        "parameter_count": str(tables * vocab * width),  # values in vocab x width tables, shared ones once
        "format": layout.fmt,
        "block_size": str(layout.block_size or 0),
    })
    check(model, lengths=lengths)  # the full checker, large tables stood in for by holes (graphs.storage.check)
    return model


def _embedding(table, layout, tied=False):
    """The table's initializers as `layout` says (graphs.precision): [embedding] or [embedding, embedding_scale]."""
    entries = precision.initializers(table, layout.fmt, layout.block_size, layout.name, layout.in_blocks)
    what = ("the output head, a table of its own" if layout.name == "lm_head" else
            "the embedding table" + ("; tied: also the output head's weight, through the view 'tie_view'" if tied else ""))
    return [(n, data, dims, elem_type, f"{what}: {doc}") for n, data, dims, elem_type, doc in entries]


def _shape_consts(consts):
    return [_const(values, name, np.int64, "a shape constant") for name, values in consts.items()]


def _decoded(layout):
    """(nodes, name, value_info) of the whole table as float32, for readers of every row."""
    nodes, name = precision.table_nodes(layout, layout.name + "_float32")
    return nodes, name, ([_value(name, FLOAT, [layout.vocab, layout.width])] if nodes else [])


IDS = ["batch", "seq"]


def _prepared(table, fmt, block_size, name="table"):
    """The table to build from: a float32 array, or a precision.Stored already in (fmt, block_size)."""
    stored = isinstance(table, precision.Stored)
    if stored and (table.fmt, table.block_size) != (fmt, block_size):
        raise ValueError(f"{name} is stored as {table.fmt} (block_size {table.block_size}); pass fmt={table.fmt!r}, "
                         f"block_size={table.block_size} to build from it")
    table = table if stored else as_table(table, name)
    precision.check_graph_format(fmt, block_size, table.shape[1])
    return table.codes if stored and fmt == "float32" else table


def _layout(table, fmt, block_size, in_blocks=False):
    """The prepared table's precision.Layout; `in_blocks`: in the block layout where precision.blocks() allows."""
    vocab, width = table.shape
    in_blocks = in_blocks and precision.blocks(fmt, block_size, width)
    return precision.Layout(fmt, block_size, vocab, width, in_blocks=in_blocks)


def gather_lookup(table, fmt="float32", block_size=None):
    """ids [batch, seq] -> embeddings [batch, seq, width] by Gather: the lookup (the table stored in `fmt`)."""
    table = _prepared(table, fmt, block_size)
    layout = _layout(table, fmt, block_size, in_blocks=True)
    nodes, consts, value_info = precision.lookup_nodes(layout, "embeddings")
    graph = helper.make_graph(nodes, "gather_lookup", [_value("ids", INT64, IDS)],
                              [_value("embeddings", FLOAT, IDS + [layout.width])],
                              doc_string="Token ids to vectors by pulling rows out of the table (Gather).",
                              value_info=value_info)
    return _model(graph, _embedding(table, layout) + _shape_consts(consts), layout)


def onehot_lookup(table, fmt="float32", block_size=None):
    """ids -> embeddings as one_hot(ids) @ embedding: the same rows, vocab*width products per id."""
    table = _prepared(table, fmt, block_size)
    layout = _layout(table, fmt, block_size)
    vocab, width = table.shape
    decode, decoded, decoded_info = _decoded(layout)
    nodes = decode + [
        _node("OneHot", ["ids", "depth", "off_on"], ["one_hot"], "one_hot",
              "a vocab-long row of 0.0 with 1.0 at the id; a negative id wraps, "
              "one >= vocab gives an all-zero row (the runner refuses both first)", axis=-1),
        _node("MatMul", ["one_hot", decoded], ["embeddings"], "select_rows",
              "one_hot @ embedding: every row times 0 or 1 and summed, so exactly the looked-up row"),
    ]
    consts = [_const([vocab], "depth", np.int64, "OneHot depth: the vocabulary size"),
              _const([0.0, 1.0], "off_on", np.float32, "OneHot values: [off, on]")]
    graph = helper.make_graph(
        nodes, "onehot_lookup", [_value("ids", INT64, IDS)], [_value("embeddings", FLOAT, IDS + [width])],
        doc_string="Token ids to vectors by multiplying one-hot rows with the table (OneHot + MatMul).",
        value_info=decoded_info + [_value("one_hot", FLOAT, IDS + [vocab])])
    return _model(graph, _embedding(table, layout) + consts, layout)


def _logits(table, head_table, tied, fmt="float32", block_size=None, accuracy_level=4):
    """The lookup plus a head that scores `hidden` against every row of `head`: FusedMatMul(transB=1) on the
    float32 table (decoded first for the other formats), or MatMulNBits on int8 / int4 codes in the block layout."""
    if accuracy_level not in precision.ACCURACY_LEVELS:
        raise ValueError(f"accuracy_level must be one of {precision.ACCURACY_LEVELS}, got {accuracy_level!r}")
    vocab, width = table.shape
    layout = _layout(table, fmt, block_size, in_blocks=True)
    head_layout = layout._replace(name="embedding" if tied else "lm_head")
    lookup, lookup_consts, value_info = precision.lookup_nodes(layout, "embeddings")
    consts = _shape_consts(lookup_consts)
    head_doc = ("logits = hidden @ embedding^T: the same table the lookup reads (weight tying)" if tied else
                "logits = hidden @ lm_head^T: a second vocab x width table, untied from the embedding")
    if layout.in_blocks:  # the codes as stored, at the speed of their bytes; onnxruntime prepacks them at load
        head = [precision.head_node(head_layout, "hidden", "logits", accuracy_level,
                                    "lm_head_tied" if tied else "lm_head",
                                    head_doc + f", from the {fmt} codes: MatMulNBits, accuracy_level {accuracy_level} ("
                                    + ("float32 products of the decoded codes" if accuracy_level == 0 else
                                       f"the hidden vector quantized to int8 per block of {block_size} too") + ")")]
    else:
        decode, decoded, decoded_info = _decoded(head_layout)
        value_info += decoded_info
        if tied and fmt == "float32":  # weight tying: the head reads the lookup's own table, through a view nothing copies
            decode, tie_consts, tie_info = unfolded_view("embedding", "hidden", [vocab, width], "tied_embedding", "tie_",
                                                           FLOAT)
            decoded = "tied_embedding"
            value_info += tie_info + [_value("tied_embedding", FLOAT, [vocab, width])]
            consts += [_const(v, k, np.int64, "the tie's view: a shape constant") for k, v in tie_consts.items()]
        # FusedMatMul (onnxruntime's MatMul with transpose flags) rather than ONNX's Gemm: Gemm takes 2-D operands,
        # so [batch, seq] needs a Reshape either side, and the one after it copies every logit when the caller gives
        # the output buffer. MatMul(hidden, Transpose(embedding)) would be folded into a [width, vocab] copy at load.
        head = decode + [_node("FusedMatMul", ["hidden", decoded], ["logits"], "lm_head_tied" if tied else "lm_head",
                               head_doc + ". transB reads it in place, so no transposed copy is made, and the "
                               "[batch, seq, vocab] logits are written straight into the output", domain="com.microsoft",
                               transB=1)]
    initializers = _embedding(table, layout, tied) + consts
    if not tied:
        initializers += _embedding(head_table, head_layout)
    name = "tied_logits" if tied else "untied_logits"
    doc = ("Lookup and output head sharing one table (weight tying): one vocab x width tensor, used twice."
           if tied else "Lookup and output head with separate tables: two vocab x width tensors.")
    graph = helper.make_graph(
        lookup + head, name, [_value("ids", INT64, IDS), _value("hidden", FLOAT, IDS + [width])],
        [_value("embeddings", FLOAT, IDS + [width]), _value("logits", FLOAT, IDS + [vocab])], doc_string=doc,
        value_info=value_info)
    model = _model(graph, initializers, layout, tied=tied, tables=1 if tied else 2)
    if layout.in_blocks:
        helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                       "accuracy_level": str(accuracy_level)})
    return model


def tied_logits(table, fmt="float32", block_size=None, accuracy_level=4):
    """ids -> embeddings and hidden -> logits, both from the one `embedding` initializer (stored in `fmt`).

    int8 / int4 with a block that is a power of two >= 16 dividing the width: the uint8 block layout, looked up by
    GatherBlockQuantized and scored by MatMulNBits at `accuracy_level` (4, the default and the fastest: the hidden
    vector is quantized to int8 per block too; 0: float32 products of the decoded codes). Other blocks keep ONNX
    INT8 / INT4 and a head that decodes the whole table with DequantizeLinear on every run."""
    table = _prepared(table, fmt, block_size)
    return _logits(table, table, tied=True, fmt=fmt, block_size=block_size, accuracy_level=accuracy_level)


def untied_logits(table, head, fmt="float32", block_size=None, accuracy_level=4):
    """ids -> embeddings from `embedding`; hidden -> logits from a separate `lm_head` of the same shape (stored and
    scored as tied_logits says)."""
    table, head = _prepared(table, fmt, block_size), _prepared(head, fmt, block_size, "head")
    if head.shape != table.shape:
        raise ValueError(f"head shape {head.shape} must equal the table's {table.shape}")
    return _logits(table, head, tied=False, fmt=fmt, block_size=block_size, accuracy_level=accuracy_level)


def scaled_lookup(table, fmt="float32", block_size=None):
    """ids -> embeddings * sqrt(width): the lookup the Transformer paper scales."""
    table = _prepared(table, fmt, block_size)
    layout = _layout(table, fmt, block_size, in_blocks=True)
    width = layout.width
    lookup, lookup_consts, lookup_info = precision.lookup_nodes(layout, "rows")
    nodes = lookup + [
        _node("Mul", ["rows", "sqrt_width"], ["embeddings"], "scale",
              f"rows * sqrt({width}): every length grows sqrt(width) times, no direction changes"),
    ]
    scale = _const(math.sqrt(width), "sqrt_width", np.float32, f"sqrt({width}) rounded to float32")
    graph = helper.make_graph(nodes, "scaled_lookup", [_value("ids", INT64, IDS)],
                              [_value("embeddings", FLOAT, IDS + [width])],
                              doc_string="Lookup then multiply by sqrt(width).",
                              value_info=lookup_info + [_value("rows", FLOAT, IDS + [width])])
    return _model(graph, _embedding(table, layout) + [scale] + _shape_consts(lookup_consts), layout)


def neighbors(table, metric="cosine", fmt="float32", block_size=None):
    """ids [n], k [1] -> the k nearest other tokens by cosine or dot: indices [n, k], scores [n, k]."""
    if metric not in ("cosine", "dot"):
        raise ValueError(f"unknown metric {metric!r}: use 'cosine' or 'dot'")
    table = _prepared(table, fmt, block_size)
    vocab, width = table.shape
    layout = _layout(table, fmt, block_size)  # the codes stay in ONNX INT8 / INT4: cosine decodes every row anyway
    lookup, _, lookup_info = precision.lookup_nodes(layout, "queries")
    decode, decoded, decoded_info = _decoded(layout)
    # the table has other readers (the queries' lookup, the norms): Gemm reads it through a view nothing copies
    view, view_consts, view_info = unfolded_view(decoded, "ids", [vocab, width], "rows_to_score", "score_",
                                                 TensorProto.INT64)
    nodes = lookup + decode + view + [
        _node("Gemm", ["queries", "rows_to_score"], ["dots"], "dots", "queries @ embedding^T: [n, vocab]", transB=1),
    ]
    value_info = lookup_info + decoded_info + view_info + [
        _value("rows_to_score", FLOAT, [vocab, width]), _value("queries", FLOAT, ["n", width]),
        _value("dots", FLOAT, ["n", vocab])]
    consts = [_const(v, k, np.int64, "the view's shape constant") for k, v in view_consts.items()] + [
              _const([vocab], "depth", np.int64, "OneHot depth: the vocabulary size"),
              _const([0.0, -np.inf], "off_self", np.float32, "added to each score: -inf on the query itself"),
              _const([vocab - 1], "others", np.int64, "at most vocab - 1 other tokens")]
    scores = "dots"
    if metric == "cosine":
        nodes += [
            _node("ReduceL2", [decoded, "width_axis"], ["norms"], "norms", "|row| for every token", keepdims=0),
            _node("Gather", ["norms", "ids"], ["query_norms"], "query_norms", "|query|", axis=0),
            _node("Unsqueeze", ["query_norms", "width_axis"], ["query_norms_col"], "as_column", "[n] -> [n, 1]"),
            _node("Mul", ["query_norms_col", "norms"], ["norm_products"], "norm_products", "|query| * |row|"),
            _node("Div", ["dots", "norm_products"], ["cosines"], "cosine", "dot / (|query| |row|): direction only"),
        ]
        value_info += [_value("norms", FLOAT, [vocab]), _value("query_norms", FLOAT, ["n"]),
                       _value("query_norms_col", FLOAT, ["n", 1]), _value("norm_products", FLOAT, ["n", vocab]),
                       _value("cosines", FLOAT, ["n", vocab])]
        consts.append(_const([1], "width_axis", np.int64, "the width axis"))
        scores = "cosines"
    nodes += [
        _node("OneHot", ["ids", "depth", "off_self"], ["self_mask"], "self_mask", "-inf at each query's own id",
              axis=-1),
        _node("Add", [scores, "self_mask"], ["others_scores"], "exclude_self", "the query sorts last"),
        _node("Min", ["k", "others"], ["k_used"], "clamp_k", "k larger than vocab - 1 gives all vocab - 1"),
        _node("TopK", ["others_scores", "k_used"], ["scores", "indices"], "top_k",
              "best first; equal scores in id order, lower id first", axis=-1, largest=1, sorted=1),
    ]
    value_info += [_value("self_mask", FLOAT, ["n", vocab]), _value("others_scores", FLOAT, ["n", vocab]),
                   _value("k_used", INT64, [1])]
    graph = helper.make_graph(
        nodes, f"neighbors_{metric}", [_value("ids", INT64, ["n"]), _value("k", INT64, [1])],
        [_value("indices", INT64, ["n", "k"]), _value("scores", FLOAT, ["n", "k"])],
        doc_string=f"The k tokens nearest each query by {metric}, the query itself excluded.", value_info=value_info)
    return _model(graph, _embedding(table, layout) + consts, layout)
