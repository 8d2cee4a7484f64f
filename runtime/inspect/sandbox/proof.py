"""The retie proof: both models run on the same decoder feeds (feeds.plan's; in a folder, an input another file
makes is that file's output); heads agree within float32's bound, the rest bit for bit. It runs in the isolated child (runtime.inspect.sandbox.isolated), since it opens sessions on an untrusted
model and runs onnx's shape inference on it."""
import os

import numpy as np
import onnx
from onnx import helper

from graphs.storage import release
from runtime.bounds import U, dot_bounds
from runtime.inspect.findings.shares import scalar_constant
from runtime.inspect.graph.scopes import scopes
from runtime.inspect.read.checked import source
from runtime.inspect.read.model import graph_paths, label, load
from runtime.inspect.sandbox.feeds import NoFeeds, describe, shaped_feeds
from runtime.resident import session_growth
from runtime.runner import Runner, layout_session


def _with_outputs(model, names):
    """`model` also outputting `names` (the hidden vectors the heads read), and {name: the output that shows it}. A
    name inside an If branch (a merged decoder's head) becomes a new output of that branch and of its If node, the
    other branch giving an empty tensor of the same type in its place: the run shows it when its branch ran."""
    present = {o.name for o in model.graph.output}
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for _, _, g in graph_paths(inferred.graph) for v in list(g.value_info) + list(g.input) +
             list(g.output)}
    known.update({v.name: v for v in model.graph.input})
    branches = _branches(model.graph)
    shown = {}
    for name in names:
        if name in present:
            shown[name] = name
            continue
        if name not in known:
            raise ValueError(f"shape inference does not type {name!r}, the input or output of a head")
        homes = [b for b in branches if any(name in n.output for n in b[0].node)]
        if not homes:  # the main graph's
            model.graph.output.append(known[name])
            shown[name] = name
            continue
        elem = known[name].type.tensor_type.elem_type
        out = f"proof_shows_{len(shown)}_{name}"
        for node in {id(n): n for _, n, _ in homes}.values():  # Optimum's branches may both write the name
            if node not in model.graph.node:
                raise ValueError(f"{name!r} lies in a branch of a branch: not shown by this proof")
            for body, _, _ in (b for b in branches if b[1] is node):
                if any(name in n.output for n in body.node):  # its own value
                    body.node.append(helper.make_node("Identity", [name], [out + "_value"]))
                else:  # the other branch: an empty tensor of the same type in its place
                    empty = helper.make_tensor("empty", elem, [0], [])
                    body.node.append(helper.make_node("Constant", [], [out + "_value"], value=empty))
                body.output.append(helper.make_tensor_value_info(out + "_value", elem, None))
            node.output.append(out)
        model.graph.output.append(helper.make_tensor_value_info(out, elem, None))
        shown[name] = out
    return model, shown


def _branches(graph):
    """[(branch, its If node, the other branch)] for every If node of `graph` and of its branches."""
    found, stack = [], [graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            if node.op_type == "If":
                bodies = {a.name: a.g for a in node.attribute if a.HasField("g")}
                if {"then_branch", "else_branch"} <= set(bodies):
                    then, other = bodies["then_branch"], bodies["else_branch"]
                    found += [(then, node, other), (other, node, then)]
                    stack += [then, other]
    return found


def _runs(session, shown, feed_sets):
    """A generator: for each feeds of `feed_sets` in turn, every output of `session` and, by their names, the
    values `shown` ({name: the output that shows it}, _with_outputs') shows. One session, run on every feed set;
    let go after the last (or when the generator is closed)."""
    names = [o.name for o in session.get_outputs()]
    for feeds in feed_sets:
        outputs = dict(zip(names, session.run(names, feeds)))
        yield {**outputs, **{name: outputs[out] for name, out in shown.items()}}


def _original(proto, folder, hidden_names, prepacking):
    """(a session of the original model, a ModelProto whose data onnxruntime reads from `folder`, with the hidden
    vectors the heads read shown as outputs; {name: output}); `prepacking`: False runs it with
    session.disable_prepacking."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    model, shown = _with_outputs(model, hidden_names)
    # onnxruntime is the judge: contrib ops are beyond the onnx checker
    return Runner(model, data_folder=folder, prepacking=prepacking).session, shown


def _head_bound(hidden, table, chunk=1 << 24):
    """2 gamma_w sum|h t| for logits hidden @ table.T, table [vocab, width] (a memory map, or a view of one), by
    runtime.bounds.dot_bounds (float64, made an upper bound) a block of rows at a time: both sides lie within
    gamma_w of the exact sum."""
    vectors = hidden.reshape(-1, hidden.shape[-1])
    rows = max(1, chunk // (8 * table.shape[1]))
    sums = []
    for i in range(0, len(table), rows):
        block = table[i:i + rows]
        sums.append(dot_bounds(block, vectors))
        if block.flags.c_contiguous:  # read once: its pages are not held beside the session (a transposed
            release(block)  # view's span the whole table: let go after)
    release(table)
    return 2 * np.concatenate(sums, axis=-1).reshape(hidden.shape[:-1] + (len(table),))


class OriginalFails(Exception):
    """onnxruntime cannot run the original model on the proof's feeds: nothing about the retie can be proven."""


def prove(job):
    """(one-line failures (empty: proven), the retied model's measured figures or None) for job {before, checked (its Model's), after, rewritten: [[output, hidden,
    table, transposed, now]], rows, shape (feeds.plan), folder, in_place (retie.branches read the weights in place:
    the original is run with prepacking off, as its kernels then read them), layout (where the retied model's
    session writes its optimized model's layout, if anywhere), measure (whether to measure that session: a single
    file's retie)}; OriginalFails when the original
    itself does not run on those feeds. The original is read as checked (isolated.source), never from a file swapped in since."""
    data, folder = source(job["checked"])
    before = load(job["before"], folder, data=data)
    del data
    flipped = {table: transposed for _, _, table, transposed, _ in job["rewritten"]}
    tables = {name: before.tensors[name].values().T if transposed else before.tensors[name].values()
              for name, transposed in flipped.items()}  # each [vocab, width], memory-mapped
    hidden_names = sorted({hidden for _, hidden, *_ in job["rewritten"] if hidden})  # None: no head rewritten
    head_of = {output: (hidden, table) for output, hidden, table, *_ in job["rewritten"] if output}
    chains = _chains(before, head_of)
    watched = hidden_names + sorted(h for h in head_of if h not in {o.name for o in before.proto.graph.output})
    feed_sets, made = [], {}  # [(sequence, what branch, feeds)]
    for sequence in job["shape"]["lengths"]:
        try:
            runs = _branch_feeds(before.proto, job["rows"], job["shape"], sequence)
        except NoFeeds as e:  # the inputs cannot be made, so nothing can be run
            raise OriginalFails(f"onnxruntime cannot run the original model on the proof's feeds "
                                f"({describe(dict(job['shape'], lengths=[sequence]))}): {e}") from None
        for branch, feeds in runs:
            for upstream in job.get("upstream", []):
                feeds = _fed_from(feeds, upstream, made)
            feed_sets.append((sequence, branch, feeds))
    made.clear()  # the other files' sessions: their outputs are fed, and are all they were for
    feeds_only = [f for *_, f in feed_sets]
    # one session of each model, run on every feed set in turn: one load each, one held at a time. The retied model
    # first, as it was staged, nothing shown: its session also writes its optimized model's layout (the copies it
    # holds) and, with job["measure"], is measured after its first run, in this process still fresh
    session = None
    try:
        session, figures = _retied(job, feeds_only[0])
        news = list(_runs(session, {}, feeds_only))
    except Exception:  # noqa: BLE001 - the retied model refused: unless the original is refused too (OriginalFails)
        session = None
        _originals(job, before, folder, watched, feed_sets)
        raise
    session = None  # let go before the original's opens
    olds = _originals(job, before, folder, watched, feed_sets)
    failures = []
    for (sequence, branch, _), old, new in zip(feed_sets, olds, news):
        failures += [f"{sequence} new token(s){branch}: {f}" for f in _compare(old, new, head_of, chains, tables)]
    return failures, figures


def _originals(job, before, folder, watched, feed_sets):
    """The original model's outputs (and the `watched` values it shows) on each of `feed_sets`, from one session;
    OriginalFails where onnxruntime refuses it (then nothing about the retie is known)."""
    olds, feeds_only = [], [f for *_, f in feed_sets]
    for sequence, branch, _ in feed_sets:
        try:
            if not olds:  # a file whose weights the retie reads in place (retie.branches) against the export unpacked
                originals = _runs(*_original(before.proto, folder, watched, not job.get("in_place")), feeds_only)
            olds.append(_outputs_of(next(originals)))
        except Exception as e:  # noqa: BLE001 - onnxruntime's refusal, whatever its type, is the finding
            raise OriginalFails(f"onnxruntime cannot run the original model on the proof's feeds "
                                f"({describe(dict(job['shape'], lengths=[sequence]))}{branch}): "
                                f"{(str(e).strip().splitlines() or [type(e).__name__])[0][:300]}") from None
    originals.close()
    return olds


def _retied(job, first):
    """(a session of the retied model at job["after"], its data beside it, under onnxruntime's defaults; what it
    added after a run on the feeds `first` (resident.session_growth's figures) where job["measure"], else None).
    It writes its optimized model's layout to job["layout"] where the job names one."""
    if job.get("measure"):
        kept = []
        figures = session_growth(job["after"], first, layout=job.get("layout"), keep=kept)
        return kept[0], figures
    if job.get("layout"):
        return layout_session(job["after"], job["layout"]), None
    return Runner(job["after"]).session, None


def _branch_feeds(model, rows, shape, sequence):
    """[(what, feeds)]: the proof's feeds, and for a merged decoder (a bool `use_cache_branch` input) the same with
    the branch that reads no past too, so that both branches run."""
    feeds = shaped_feeds(model, rows, shape, sequence)
    if "use_cache_branch" not in feeds or feeds["use_cache_branch"].dtype != np.bool_:
        return [("", feeds)]
    return [(", use_cache_branch true", feeds),
            (", use_cache_branch false", dict(feeds, use_cache_branch=np.zeros_like(feeds["use_cache_branch"])))]


def _fed_from(feeds, upstream, made):
    """`feeds` with input upstream["input"] replaced by what the file that makes it gives: upstream {input, output,
    checked, rows, shape} names another file of the folder (the encoder whose last_hidden_state a decoder reads as
    encoder_hidden_states, the embed_tokens.onnx whose rows a split decoder reads as inputs_embeds), run as checked
    on its own feeds of the same sequence length. `made` keeps each producer's session and each output it gave (a
    merged decoder's two branches are fed the same value, one session a file)."""
    name = upstream["input"]
    if name not in feeds or feeds[name].ndim < 2:
        return feeds
    path, length = upstream["checked"]["path"], feeds[name].shape[1]
    if path not in made:
        data, folder = source(upstream["checked"])
        producer = load(path, folder, data=data)
        del data
        made[path] = (producer.proto, Runner(producer.proto, data_folder=folder).session)
    proto, session = made[path]
    if (path, upstream["output"], length) not in made:
        (made[path, upstream["output"], length],) = session.run(
            [upstream["output"]], shaped_feeds(proto, upstream["rows"], upstream["shape"], length))
    value = made[path, upstream["output"], length]
    if value.shape != feeds[name].shape or value.dtype != feeds[name].dtype:
        return feeds  # not the input it feeds, after all: the random one stays
    return dict(feeds, **{name: value})


def _outputs_of(run):
    """A run's graph outputs and watched values, less the outputs that only show a watched value."""
    return {k: v for k, v in run.items() if not k.startswith("proof_shows_")}


ULPS_PER_OP = 8  # what one float32 elementwise op adds, each side: 1/2 ulp rounding, MLAS's Tanh a few more


def _chains(model, head_of):
    """{output: [(head output, Lipschitz constant, ops)]}: each output (a graph output, or the head's own) that a
    rewritten head's output reaches through elementwise ops whose change of their input is bounded by a constant
    factor: Div / Mul by a scalar constant (1/|c|, |c|), Add / Sub of a constant of any shape (1), Tanh and Identity
    (1), as the soft-capped logits of Gemma2 (30 tanh(x / 30)) and the biased logits of BART and Marian are; from an
    If branch's output on through its If node's (both branches' heads then reach the same output: the run says which
    branch ran)."""
    maps, branch_of, starts = {}, {}, []
    for path, body, order, producer, consumers in scopes(model.proto.graph):
        maps[path] = (body, producer, consumers)
        for node in order:
            if node.op_type == "If":
                branch_of.update({f"{path}/{label(node)}.{a.name}": (node, path) for a in node.attribute})
        starts += [(path, head) for head in head_of if any(head in n.output for n in order)]
    found = {}
    for path, head in starts:  # each graph that writes it: Optimum's two branches may write the same name
        name, lipschitz, ops = head, 1.0, 0
        if (head, 1.0, 0) not in found.setdefault(head, []):
            found[head].append((head, 1.0, 0))
        for _ in range(sum(len(b.node) for b, *_ in maps.values()) + len(maps)):  # each step a node or a branch
            body, producer, consumers = maps[path]
            outputs = [o.name for o in body.output]
            if name in outputs:
                if path == "main":
                    if (head, lipschitz, ops) not in found.setdefault(name, []):
                        found[name].append((head, lipschitz, ops))
                    break
                node, parent = branch_of.get(path, (None, None))
                if node is None or len(node.output) <= outputs.index(name):
                    break
                name, path = node.output[outputs.index(name)], parent
                continue
            readers = consumers.maps[0].get(name, [])  # its own graph's readers: a branch output goes on via the If
            node = readers[0] if len(readers) == 1 and readers[0].output else None
            if node is None:
                break
            if node.op_type in ("Tanh", "Identity"):
                factor = 1.0
            elif node.op_type in ("Add", "Sub") and len(node.input) == 2 and name in node.input and \
                    _constant_tensor(node.input[1] if node.input[0] == name else node.input[0], producer, model):
                factor = 1.0  # a constant added, of any shape (BART's and Marian's final_logits_bias): the same on
                # both sides, so the difference passes unchanged, less the rounding ULPS_PER_OP counts
            elif node.op_type in ("Div", "Mul", "Add", "Sub") and len(node.input) == 2 and name in node.input:
                other = node.input[1] if node.input[0] == name else node.input[0]
                c = scalar_constant(other, producer, model)
                if c is None or not np.isfinite(c) or (node.op_type == "Div" and (node.input[0] != name or c == 0)):
                    break
                factor = 1 / abs(c) if node.op_type == "Div" else abs(c) if node.op_type == "Mul" else 1.0
            else:
                break
            lipschitz, ops, name = lipschitz * factor, ops + 1, node.output[0]
    return found


def _constant_tensor(name, producer, model):
    """Whether `name` is an initializer of the main graph or a Constant node's output: the same in both runs."""
    node = producer.get(name)
    return name in model.tensors or (node is not None and node.op_type == "Constant")


def _compare(old, new, head_of, chains, tables):
    """Failures comparing two runs' outputs: a head's, and what it reaches through a bounded chain (_chains), within
    the head's bound times the chain's constant plus ULPS_PER_OP ulps per op on each side; the rest bit for bit."""
    failures = [f"output {name!r}: the original has none of that name" for name in new if name not in old]
    for name in (n for n in new if n in old):  # the original's also shows the hidden vectors the bound reads
        a, b = old[name], new[name]
        ran = [c for c in chains.get(name, []) if old[head_of[c[0]][0]].size]  # the heads whose branch ran
        if a.shape != b.shape or a.dtype != b.dtype:
            failures.append(f"output {name!r}: {a.shape} {a.dtype} became {b.shape} {b.dtype}")
        elif name in chains and not a.size:
            continue  # a value of the branch that did not run: both sides show it empty
        elif len(ran) == 1:
            head, lipschitz, ops = ran[0]
            hidden, table = head_of[head]
            bound = lipschitz * _head_bound(old[hidden], tables[table])
            bound += ops * ULPS_PER_OP * U * (np.abs(a.astype(np.float64)) + np.abs(b))
            if np.isnan(b).any() or not np.all(np.abs(a.astype(np.float64) - b) <= bound):
                via = f" (through {ops} elementwise op(s) from the head, factor {lipschitz:g})" if ops else ""
                failures.append(f"output {name!r}: differs beyond 2 gamma_w sum|a b|{via}")
        elif not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            failures.append(f"output {name!r}: not bit-identical, and not a head output whose bound is known")
    return failures
