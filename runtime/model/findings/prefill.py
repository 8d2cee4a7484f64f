"""The head at prefill: whether a decoder's logits head scores every prompt position (its scores follow the
sequence axis to a graph output), and the bytes of logits and the multiply-adds that makes at a prompt length,
counted from the graph (sandbox.timing measures the time on request)."""
from onnx import helper

PROMPT = 2048  # prompt tokens the cost is stated at, unless the model declares a shorter context

KEEP = "num_logits_to_keep"  # transformers.js's input: how many last positions the head scores (0: all)

# one a layer: the ops whose inputs are the scores and values of attention (counted as tokens^2 x width, twice)
ATTENTION = ("Softmax", "Attention", "MultiHeadAttention", "GroupQueryAttention", "SparseAttention", "PackedAttention")


def _attentions(graph):
    """The attention ops (ATTENTION) one run of `graph` passes: its own, the larger branch of each If (a run takes
    one), every other body once."""
    count = 0
    for node in graph.node:
        count += node.op_type in ATTENTION
        bodies = [_attentions(a.g) for a in node.attribute if a.type == a.GRAPH]
        count += (max(bodies) if node.op_type == "If" else sum(bodies)) if bodies else 0
    return count


def multiply_adds(model, heads, tokens, width):
    """({head initializer: its multiply-adds}, the whole prefill's, what was counted) of one prefill of `tokens`
    prompt tokens, from the graph alone: each matmul weight (`heads`: every one find_tables_and_heads found, each
    counted once however many graphs read it) tokens x its vocab x width; each attention op (_attentions)
    2 x tokens^2 x `width` (the logits head's: the hidden size; its scores, then its values, every position against
    every one, as a prefill's kernels compute it). Norms, activations and lookups are not counted."""
    weights = {h.initializer: h.vocab * h.width for h in heads}
    layers = _attentions(model.proto.graph)
    total = tokens * sum(weights.values()) + 2 * tokens * tokens * width * layers
    what = (f"{tokens} tokens x the elements of {len(weights)} matmul weight{'s' if len(weights) != 1 else ''}"
            + (f", and {layers} attention op{'s' if layers != 1 else ''} x 2 x {tokens}^2 x {width}" if layers else ""))
    return {name: tokens * n for name, n in weights.items()}, total, what


def main_output(model, head):
    """The main graph's output that head's scores become: its own graph's output where the head is read in the
    main graph, else the output of the If at the place its branch's output takes (a merged decoder), or None."""
    name = head.scores
    if not name or head.graph == "main":
        return name
    body = head.body
    at = [o.name for o in body.output].index(name)
    for node in model.proto.graph.node:
        branches = [a.g.name for a in node.attribute if a.type == a.GRAPH] if node.op_type == "If" else []
        if body.name in branches and at < len(node.output):
            return node.output[at]
    return None


def prompt_tokens(info, asked=None):
    """The prompt length the cost is stated at: `asked` (--prompt-length), else PROMPT or the model's declared
    context (its config's, or its position table's rows) where shorter."""
    if asked:
        return asked
    declared = [info.shape.get("context")] + [v["vocab_size"] for v in info.vocabulary if v["kind"] == "position"]
    return min([PROMPT] + [n for n in declared if n])


def all_positions(info, model, asked=None):
    """[{head, output, prompt_tokens, vocab_size, logits_bytes, row_bytes, counted}]: each logits output of a decoder
    whose head scores every position: its position axis (the one before the vocabulary) is not 1; `counted` its
    head's and the whole prefill's multiply-adds (multiply_adds) and what was counted. Empty for a
    sequence-to-sequence decoder (its prompt is the encoder's, read once) and for one a client tells how many
    positions to score (an input KEEP, as --retie --logits-to-keep adds)."""
    graph = model.proto.graph
    if any(i.name in ("encoder_hidden_states", KEEP) for i in graph.input):
        return []
    outputs, found = {o.name: o for o in graph.output}, {}
    tokens = prompt_tokens(info, asked)
    for head in info.heads:
        out = outputs.get(main_output(model, head))
        if out is None or out.name in found or not out.type.HasField("tensor_type"):
            continue
        dims = out.type.tensor_type.shape.dim
        if len(dims) < 3 or (dims[-2].HasField("dim_value") and dims[-2].dim_value == 1):
            continue
        try:
            size = helper.tensor_dtype_to_np_dtype(out.type.tensor_type.elem_type).itemsize
        except KeyError:  # an undefined or unknown element type: no bytes to state
            continue
        found[out.name] = {"head": head.initializer, "output": out.name, "prompt_tokens": tokens,
                           "vocab_size": head.vocab, "logits_bytes": tokens * head.vocab * size,
                           "row_bytes": head.vocab * size, "width": head.width}
    if found:  # counted once for every head: one pass over the graph
        heads, total, what = multiply_adds(model, info.heads, tokens, max(p.pop("width") for p in found.values()))
        for p in found.values():
            p["counted"] = {"head_multiply_adds": heads[p["head"]], "multiply_adds": total, "what": what}
    return list(found.values())
