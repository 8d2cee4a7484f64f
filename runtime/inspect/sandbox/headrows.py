"""What --retie --lookup-from-head proves and measures, in the isolated child: every id's looked-up row in the retied
model against the head's own dequantization (retie.headlookup.head_rows, computed apart from onnxruntime), bit for
bit; and, since the rows change, how often greedy decoding still picks the original's tokens."""
import os

import numpy as np
import onnx
from onnx import helper, numpy_helper

from runtime.model.read.checked import source
from runtime.model.read.model import load
from runtime.feeds import no_past_branch, shaped_feeds
from runtime.runner import Runner
from runtime.inspect.sandbox import answers

IDS_AT_ONCE = 8192  # ids looked up a run: 8192 rows of a 2048-wide float32 table are 64 MiB

PROMPTS, NEW_TOKENS, PROMPT_LENGTH = 8, 16, 4  # the greedy runs: fixed prompts of random ids (seed 0)


def swap_tables(proto, job):
    """Make the original `proto` hold, in place of each float table job["replaced"] names ({table: {"rows": .npy
    [vocab, width], "transposed"}}), the head's rows in the table's stored layout and type, inline: every output
    but the looked-up rows' own can then be compared with the retied model's bit for bit. (Not a session's
    add_initializer: onnxruntime folds a Transpose of the table with the file's values before it applies one.)"""
    for tensor in proto.graph.initializer:
        spec = (job.get("replaced") or {}).get(tensor.name)
        if spec is None:
            continue
        rows = np.load(spec["rows"], mmap_mode="r")
        values = np.ascontiguousarray(rows.T if spec["transposed"] else rows)
        tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    for spec in (job.get("replaced") or {}).values():
        if spec.get("head"):
            requantize_head(proto, spec["head"])


def requantize_head(proto, head):
    """Make the original's MatMulNBits head (jobs.requantized's `head`) multiply the codes and scales --shared-int8
    made, as OUT's head does: the arrays added as initializers, its inputs and attributes set, its zero points
    dropped. The original then differs from OUT in its lookup alone."""
    node = next(n for n in proto.graph.node if n.output[:1] == [head["output"]])
    for name, path in zip(head["names"], head["arrays"]):
        proto.graph.initializer.append(numpy_helper.from_array(np.load(path), name))
    node.input[1], node.input[2] = head["names"]
    if len(node.input) > 3:
        node.input[3] = ""
        while node.input and not node.input[-1]:
            node.input.pop()
    kept = [a for a in node.attribute if a.name not in head["attributes"]]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(k, v) for k, v in head["attributes"].items()])


def check(job):
    """answers.LookedUp for a head_lookup job (jobs.head_lookup): each lookup's rows_equal(), the greedy runs'
    agreement()."""
    after = onnx.load(job["after"], load_external_data=False)
    rows = [rows_equal(after, job["after"], lookup) for lookup in job["lookups"]]
    ids = _lookup_model(after, job["lookups"][0]["output"]).graph.input[0].name  # the model's token ids
    checked = source(job["checked"])
    before = load(job["checked"]["path"], checked.folder, data=checked.shell)
    olds = greedy(Runner(before.proto, data_folder=checked.folder).session, before.proto, ids, job)
    news = greedy(Runner(job["after"]).session, after, ids, job)
    return answers.LookedUp(rows, answers.Agreement(
        **agreement(olds, news), prompts_from="the model's tokenizer" if job.get("prompts") else "fixed ids"))


def _lookup_model(proto, output):
    """The part of `proto` that makes `output` (the looked-up rows) from the graph's inputs, as a model of its own
    whose initializers keep their external data references."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    needed, stack = set(), [output]
    while stack:
        node = producer.get(stack.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack.extend(node.input)
    nodes = [n for n in proto.graph.node if id(n) in needed]
    read = {name for n in nodes for name in n.input}
    made = {name for n in nodes for name in n.output}
    graph = helper.make_graph(nodes, "lookup", [v for v in proto.graph.input if v.name in read],
                              [helper.make_empty_tensor_value_info(output)],
                              [t for t in proto.graph.initializer if t.name in read],
                              value_info=[v for v in proto.graph.value_info if v.name in made])  # shapes declared
    return helper.make_model(graph, opset_imports=proto.opset_import, ir_version=proto.ir_version)


def rows_equal(proto, path, lookup):
    """Whether the retied model's lookup gives, for every id, the head's own row (lookup["rows"], .npy) bit for
    bit: an answers.RowsChecked (its first_different: the first id whose row differs, or None)."""
    expected = np.load(lookup["rows"], mmap_mode="r")
    model = _lookup_model(proto, lookup["output"])
    (ids,) = model.graph.input  # the token ids, whatever reshapes them on the way
    rank, dtype = len(ids.type.tensor_type.shape.dim), helper.tensor_dtype_to_np_dtype(ids.type.tensor_type.elem_type)
    session = Runner(model, data_folder=os.path.dirname(os.path.abspath(path))).session
    first = None
    for t0 in range(0, expected.shape[0], IDS_AT_ONCE):
        t1 = min(expected.shape[0], t0 + IDS_AT_ONCE)
        (got,) = session.run([lookup["output"]], {ids.name: np.arange(t0, t1, dtype=dtype).reshape(
            [1] * (rank - 1) + [t1 - t0])})
        got, want = got.reshape(t1 - t0, -1), np.asarray(expected[t0:t1])
        if got.shape != want.shape or got.dtype != want.dtype:
            first = t0
            break
        same = np.all(got.view(np.uint8).reshape(t1 - t0, -1) == want.view(np.uint8).reshape(t1 - t0, -1), axis=1)
        if not same.all():  # compared as bits: a NaN row equals only itself
            first = t0 + int(np.argmin(same))
            break
    return answers.RowsChecked(lookup["table"], first is None, first)


def prompts(vocab):
    """PROMPTS fixed prompts of PROMPT_LENGTH ids below `vocab` (seed 0): the same for both models."""
    return np.random.default_rng(0).integers(0, vocab, size=(PROMPTS, PROMPT_LENGTH)).tolist()


def greedy(session, proto, ids, job):
    """[(NEW_TOKENS greedy tokens, the first step's last-position logits)] of each prompt, each step the whole
    sequence run again from an empty past (no cache: the same computation for both models, whatever cache layout
    the model has); a merged decoder's use_cache_branch false."""
    found = []
    for prompt in job.get("prompts") or prompts(job["vocab"]):
        tokens, first = list(prompt), None
        for _ in range(NEW_TOKENS):
            feeds = shaped_feeds(proto, job["rows"], job["shape"], len(tokens), past=0)
            feeds[ids] = np.array([tokens], dtype=feeds[ids].dtype)
            no_past_branch(feeds)
            (logits,) = session.run([job["logits"]], feeds)
            last = logits.reshape(-1, logits.shape[-1])[-1]
            first = last.astype(np.float64) if first is None else first
            tokens.append(int(np.argmax(last)))
        found.append((tokens[len(prompt):], first))
    return found


def agreement(olds, news):
    """{"prompts", "tokens", "agreed" (tokens the retied model picks as the original did before they first differ,
    summed over prompts), "same_first" (prompts whose first token is the same), "max_logit_change" (the first
    step's largest |logit change|)}."""
    agreed = same_first = 0
    most = 0.0
    for (old, old_first), (new, new_first) in zip(olds, news):
        run = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), len(old))
        agreed += run
        same_first += run > 0
        most = max(most, float(np.max(np.abs(old_first - new_first))))
    return {"prompts": len(olds), "tokens": sum(len(t) for t, _ in olds), "agreed": agreed, "same_first": same_first,
            "max_logit_change": most}
