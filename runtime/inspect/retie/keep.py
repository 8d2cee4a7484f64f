"""--logits-to-keep K: a decoder's head scores only the last k prompt positions. The transformers.js convention: an
int64 scalar input `num_logits_to_keep` (an initializer of the same name holds K, its value when a client feeds
none) whose value k keeps the last k positions of the hidden state before the head; 0 keeps them all. A Slice on
the sequence axis, start -max(k, 0): -0 is 0, the whole axis (a negative k too); a k past the prompt's length is
clamped to all of it."""
import dataclasses

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from runtime.model.findings.prefill import KEEP, main_output
from runtime.model.graph.ops import KEEPS_RANK, MATMULS
from runtime.model.graph.quantized import attribute
from runtime.model.read.text import InspectError
from runtime.inspect.retie.edits import const, unique_name
from runtime.inspect.sandbox.jobs import KeptHead

_SLICED_HEADS = tuple(op for op, facts in MATMULS.items() if facts.sliceable)


def why_not(model, info):
    """Why --logits-to-keep cannot slice this model's head (one line), or None: no head scores every prompt
    position (inspect's prefill finding), the head is not one that keeps the hidden state's rank, or its scores
    are reshaped on the way to the logits output (the sequence axis is then not known to be the one sliced)."""
    if KEEP in {i.name for i in model.proto.graph.input} | set(model.tensors):
        return f"the model already has a tensor named {KEEP}"
    if not info.prefill:
        return "no logits head scores every prompt position (nothing to keep)"
    if model.proto.ir_version < 4:
        return f"IR version {model.proto.ir_version}: an input's default needs IR 4 or later"
    for head in _heads(model, info):
        node = head.node
        if node.op_type == "FusedMatMul" and (attribute(node, "transA", 0) or attribute(node, "transBatchA", 0)):
            return (f"the head {head.initializer} is a FusedMatMul reading its hidden state transposed: the "
                    "sequence axis is not the one --logits-to-keep slices")
        retied = retied_head(head)
        if node.op_type not in _SLICED_HEADS and not retied:
            return (f"the head {head.initializer} is read by {node.op_type}, which flattens the hidden state: "
                    f"--logits-to-keep slices the [batch, sequence, width] input of {', '.join(_SLICED_HEADS)}")
        if not _rank_kept(node, head.consumers, head.scores, retied and retied[3]):
            return (f"the head {head.initializer}'s scores are reshaped on the way to {head.scores}: the "
                    "sequence axis is not known there")
    return None


FIX = "--retie OUT --logits-to-keep 1"  # the fix, as a user types it


def fix(model, info):
    """(the command that makes this model's head score only the last position, or None; why not, or None)."""
    why = why_not(model, info)
    return (None, why) if why else (FIX, None)


def _heads(model, info):
    """The head entries whose scores become a logits output that scores every prompt position."""
    outputs = {p["output"] for p in info.prefill}
    return [h for h in info.heads if h.scores and main_output(model, h) in outputs]


def retied_head(head):
    """(hidden, Shape, flatten, unflatten) of a head --retie made (rewrite._gemm_head: Shape(hidden) and
    Reshape(hidden, [-1, width]) -> Gemm(transB=1) -> Reshape(., Concat(Slice(Shape(hidden)), [vocab]))), told by
    that structure alone, whatever its nodes are named; None for any other head."""
    node, producer, consumers = head.node, head.producer, head.consumers
    if node.op_type != "Gemm" or attribute(node, "transB", 0) != 1:
        return None
    flatten, after = producer.get(node.input[0]), consumers.get(node.output[0], [])
    if flatten is None or flatten.op_type != "Reshape" or len(after) != 1 or after[0].op_type != "Reshape":
        return None
    hidden, unflatten = flatten.input[0], after[0]
    concat = producer.get(unflatten.input[1])
    lead = producer.get(concat.input[0]) if concat is not None and concat.op_type == "Concat" else None
    shape = producer.get(lead.input[0]) if lead is not None and lead.op_type == "Slice" else None
    if shape is None or shape.op_type != "Shape" or shape.input[0] != hidden:
        return None
    return hidden, shape, flatten, unflatten


def _rank_kept(node, consumers, output, unflatten=None):
    """Whether head `node`'s product reaches `output` through elementwise ops only (no view changes its rank): the
    Reshape back to [batch, sequence, vocab] of a head --retie made (`unflatten`) counts as one."""
    todo, seen = [node.output[0]], set()
    while todo:
        name = todo.pop()
        if name == output:
            return True
        if name in seen:
            continue
        seen.add(name)
        todo += [n.output[0] for n in consumers.get(name, [])
                 if n.output and (n.op_type in KEEPS_RANK or n is unflatten)]
    return False


def keep_last(model, info, default):
    """Add input KEEP (its default `default`, 0 or 1) to `model.proto` and slice the hidden state each logits head
    reads (main graph, or each If branch of a merged decoder) to its last k positions; each logits output declares
    the default's positions (_positions). InspectError where why_not says it cannot. Returns {"input",
    "outputs": the logits outputs, "heads": {head output: sandbox.jobs.KeptHead}, "renamed": {sliced name:
    hidden}}, for the proof."""
    why = why_not(model, info)
    if why:
        raise InspectError(f"--logits-to-keep: {why}")
    graph = model.proto.graph
    prefix = unique_name(model, "keep") + "_"
    graph.input.append(helper.make_tensor_value_info(KEEP, TensorProto.INT64, []))
    graph.initializer.append(numpy_helper.from_array(np.array(default, dtype=np.int64), KEEP))
    start = prefix + "start"  # [-max(k, 0)]: in the main graph, read by a branch from outside
    graph.node.insert(0, helper.make_node("Max", [KEEP, const(graph, prefix + "zero", 0)], [prefix + "k"],
                                          name=prefix + "k", doc_string="a negative k keeps every position, as 0"))
    graph.node.insert(1, helper.make_node("Neg", [prefix + "k"], [prefix + "minus_k"], name=prefix + "minus_k"))
    graph.node.insert(2, helper.make_node("Reshape", [prefix + "minus_k", const(graph, prefix + "one", [1])], [start],
                                          name=prefix + "start"))
    end, axis = const(graph, prefix + "end", [np.iinfo(np.int64).max]), const(graph, prefix + "axis", [-2])
    heads, renamed, outputs = {}, {}, set()
    for number, head in enumerate(_heads(model, info)):
        body, node = head.body, head.node
        retied = retied_head(head)
        readers = list(retied[1:3]) if retied else [node]  # a head --retie made reads it in two nodes
        hidden, kept = readers[0].input[0], f"{prefix}{number}_hidden"
        body.node.insert(min(list(body.node).index(n) for n in readers), helper.make_node(
            "Slice", [hidden, start, end, axis], [kept], name=f"{prefix}{number}_last_k",
            doc_string=f"the last {KEEP} positions of {hidden} (0: all), sliced before the head; {KEEP} is an "
                       "input with a default so that a client may ask for every position (perplexity) or the last"))
        for reader in readers:
            reader.input[:] = [kept if i == hidden else i for i in reader.input]
        renamed[kept] = hidden
        quantized = head.format != "float32" or head.quant is not None
        # what the head makes of [batch, sequence, width] rows: a head --retie made, its Reshape back to them
        made = retied[3].output[0] if retied else node.output[0]
        heads[made] = KeptHead(hidden, head.initializer, bool(head.as_table), not quantized, _nbits(head))
        outputs.add(main_output(model, head))
        if body is not graph:
            _positions(body, head.scores, None)  # a branch's: as the If's output is declared, and no more
    for value in graph.output:
        if value.name in outputs and default == 1:
            _positions(graph, value.name, 1)
    return {"input": KEEP, "outputs": sorted(outputs), "heads": heads, "renamed": renamed}


def _nbits(head):
    """What the proof needs to bound a MatMulNBits head's product ({quant: its graph.quantized.Quant's fields,
    block_size, accuracy_level}), or None for any other head."""
    node = head.node
    if node.op_type != "MatMulNBits" or head.quant is None:
        return None
    return {"quant": dataclasses.asdict(head.quant), "block_size": attribute(node, "block_size", 0),
            "accuracy_level": attribute(node, "accuracy_level", 0)}


def _positions(graph, name, value):
    """Declare output `name` of `graph` [..., value, vocab] (None: [..., ?, vocab]). The default's own: 1 where it
    keeps one position (a client that sizes its buffers by the declared shape, as Optimum's IO binding does,
    sizes them right), and as the original declares it where it keeps them all; fed another k, onnxruntime
    warns that the shape differs from the declared one."""
    for output in graph.output:
        dims = output.type.tensor_type.shape.dim if output.name == name else []
        if len(dims) >= 2:
            dims[-2].Clear()
            if value is not None:
                dims[-2].dim_value = value
