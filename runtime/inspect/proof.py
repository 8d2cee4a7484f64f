"""The retie proof: both models run on the same random inputs; heads agree within float32's bound, the rest
bit for bit. It runs in the isolated child (runtime.inspect.isolated), since it opens sessions on an untrusted
model and runs onnx's shape inference on it."""
import os

import numpy as np
import onnx

from runtime.compare.bounds import U, gamma
from runtime.inspect.feeds import describe, shaped_feeds
from runtime.inspect.isolated import source
from runtime.inspect.reading import load
from runtime.inspect.shares import scalar_constant
from runtime.runner import Runner


def _with_outputs(model, names):
    """`model` also outputting `names` (the hidden vectors the heads read)."""
    present = {o.name for o in model.graph.output}
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for v in list(inferred.graph.value_info) + list(model.graph.input)}
    for name in names:
        if name not in present:
            if name not in known:
                raise ValueError(f"shape inference does not type {name!r}, the input of a head")
            model.graph.output.append(known[name])
    return model


def _outputs(proto, folder, hidden_names, feeds):
    """Every output of the model (a ModelProto, its external data not loaded), and the hidden vectors the heads
    read, on `feeds`. Its tensor data is left to onnxruntime, read from `folder`: one session at a time holds it."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    model = _with_outputs(model, hidden_names)
    session = Runner(model, data_folder=folder).session  # onnxruntime is the judge: contrib ops are beyond
    names = [o.name for o in session.get_outputs()]      # the onnx checker
    return dict(zip(names, session.run(names, feeds)))


def _head_bound(hidden, table, chunk=1 << 24):
    """2 gamma_w sum|h t| for logits hidden @ table.T, table [vocab, width] (a memory map, or a view of one),
    computed a block of rows at a time: both sides lie within gamma_w of the exact sum."""
    h = np.abs(hidden.astype(np.float64))
    width = table.shape[1]
    rows = max(1, chunk // (8 * width))
    sums = np.concatenate([h @ np.abs(table[i:i + rows].astype(np.float64)).T for i in range(0, len(table), rows)],
                          axis=-1)
    return 2 * gamma(width) * sums


class OriginalFails(Exception):
    """onnxruntime cannot run the original model on the proof's feeds: nothing about the retie can be proven."""


def prove(job):
    """One-line failures (empty: proven) for job {before, checked (its Model's), after, rewritten: [[output, hidden,
    table, transposed, now]], rows, shape (feeds.plan), folder}; OriginalFails when the original itself does not run
    on those feeds. The original is read as checked (isolated.source), never from a file swapped in since."""
    data, folder = source(job["checked"])
    before = load(job["before"], data=data)
    del data
    after = onnx.load(job["after"], load_external_data=False)
    flipped = {table: transposed for _, _, table, transposed, _ in job["rewritten"]}
    tables = {name: before.tensors[name].values().T if transposed else before.tensors[name].values()
              for name, transposed in flipped.items()}  # each [vocab, width], memory-mapped
    hidden_names = sorted({hidden for _, hidden, *_ in job["rewritten"] if hidden})  # None: no head rewritten
    head_of = {output: (hidden, table) for output, hidden, table, *_ in job["rewritten"] if output}
    chains = _chains(before, head_of)
    watched = hidden_names + sorted(h for h in head_of if h not in {o.name for o in before.proto.graph.output})
    failures = []
    for sequence in job["shape"]["lengths"]:
        try:
            feeds = shaped_feeds(before.proto, job["rows"], job["shape"], sequence)
            old = _outputs(before.proto, folder, watched, feeds)
        except Exception as e:  # noqa: BLE001 - onnxruntime's refusal, whatever its type, is the finding
            raise OriginalFails(f"onnxruntime cannot run the original model on the proof's feeds "
                                f"({describe(dict(job['shape'], lengths=[sequence]))}): "
                                f"{(str(e).strip().splitlines() or [type(e).__name__])[0][:300]}") from None
        new = _outputs(after, os.path.dirname(job["after"]), watched, feeds)
        failures += [f"{sequence} new token(s): {f}" for f in _compare(old, new, head_of, chains, tables)]
    return failures


ULPS_PER_OP = 8  # what one float32 elementwise op adds, each side: 1/2 ulp rounding, MLAS's Tanh a few more


def _chains(model, head_of):
    """{output: (head output, Lipschitz constant, ops)}: each output (a graph output, or the head's own) that a
    rewritten head's output reaches through elementwise ops whose change of their input is bounded by a constant
    factor: Div / Mul by a scalar constant (1/|c|, |c|), Add / Sub of one (1), Tanh and Identity (1), as the
    soft-capped logits of Gemma2 (30 tanh(x / 30)) are."""
    graph = model.proto.graph
    producer = {out: node for node in graph.node for out in node.output}
    consumers = {}
    for node in graph.node:
        for name in dict.fromkeys(node.input):
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    found = {}
    for head in head_of:
        name, lipschitz, ops = head, 1.0, 0
        found[head] = (head, 1.0, 0)
        while name not in outputs:
            readers = consumers.get(name, [])
            node = readers[0] if len(readers) == 1 and readers[0].output else None
            if node is None:
                break
            if node.op_type in ("Tanh", "Identity"):
                factor = 1.0
            elif node.op_type in ("Div", "Mul", "Add", "Sub") and len(node.input) == 2 and name in node.input:
                other = node.input[1] if node.input[0] == name else node.input[0]
                c = scalar_constant(other, producer, model)
                if c is None or not np.isfinite(c) or (node.op_type == "Div" and (node.input[0] != name or c == 0)):
                    break
                factor = 1 / abs(c) if node.op_type == "Div" else abs(c) if node.op_type == "Mul" else 1.0
            else:
                break
            lipschitz, ops, name = lipschitz * factor, ops + 1, node.output[0]
        else:
            found[name] = (head, lipschitz, ops)
    return found


def _compare(old, new, head_of, chains, tables):
    """Failures comparing two runs' outputs: a head's, and what it reaches through a bounded chain (_chains), within
    the head's bound times the chain's constant plus ULPS_PER_OP ulps per op on each side; the rest bit for bit."""
    failures = []
    for name in old:
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            failures.append(f"output {name!r}: {a.shape} {a.dtype} became {b.shape} {b.dtype}")
        elif name in chains:
            head, lipschitz, ops = chains[name]
            hidden, table = head_of[head]
            bound = lipschitz * _head_bound(old[hidden], tables[table])
            bound += ops * ULPS_PER_OP * U * (np.abs(a.astype(np.float64)) + np.abs(b))
            if np.isnan(b).any() or not np.all(np.abs(a.astype(np.float64) - b) <= bound):
                via = f" (through {ops} elementwise op(s) from the head, factor {lipschitz:g})" if ops else ""
                failures.append(f"output {name!r}: differs beyond 2 gamma_w sum|a b|{via}")
        elif not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            failures.append(f"output {name!r}: not bit-identical, and not a head output whose bound is known")
    return failures
