"""The head at prefill: whether a decoder's logits head scores every prompt position (its scores follow the
sequence axis to a graph output), and the bytes of logits that makes at a prompt length, counted from the graph."""
from onnx import helper

PROMPT = 2048  # prompt tokens the cost is stated at, unless the model declares a shorter context

KEEP = "num_logits_to_keep"  # transformers.js's input: how many last positions the head scores (0: all)


def main_output(model, head):
    """The main graph's output that head's scores become: its own graph's output where the head is read in the
    main graph, else the output of the If at the place its branch's output takes (a merged decoder), or None."""
    name = head.get("scores")
    if not name or head.get("graph", "main") == "main":
        return name
    body = head["body"]
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
    declared = [info["shape"].get("context")] + [v["vocab_size"] for v in info["vocabulary"] if v["kind"] == "position"]
    return min([PROMPT] + [n for n in declared if n])


def all_positions(info, model, asked=None):
    """[{head, output, prompt_tokens, vocab_size, logits_bytes, row_bytes}]: each logits output of a decoder whose
    head scores every position: its position axis (the one before the vocabulary) is not 1. Empty for a
    sequence-to-sequence decoder (its prompt is the encoder's, read once) and for one a client tells how many
    positions to score (an input KEEP, as --retie --logits-to-keep adds)."""
    graph = model.proto.graph
    if any(i.name in ("encoder_hidden_states", KEEP) for i in graph.input):
        return []
    outputs, found = {o.name: o for o in graph.output}, {}
    tokens = prompt_tokens(info, asked)
    for head in info["heads"]:
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
        found[out.name] = {"head": head["initializer"], "output": out.name, "prompt_tokens": tokens,
                           "vocab_size": head["vocab"], "logits_bytes": tokens * head["vocab"] * size,
                           "row_bytes": head["vocab"] * size}
    return list(found.values())
