"""Whether the retied model's outputs agree with the original's: a head's, and what it reaches through elementwise
ops of bounded effect, within float32's bound on a dot product (2 gamma_w sum|h t|; a float16 / bfloat16 head's
float32 sums are then rounded to its format once more: runtime.bounds.rounded_apart), times the chain's constant,
plus a few ulps an op; every other output bit for bit. The proof (runtime.inspect.sandbox.proof) runs the models;
this judges their outputs."""
import numpy as np
from onnx import TensorProto

from graphs.arrays import release
from runtime.bounds import NARROW, bound_words, dot_bounds, quantized_head_bound, rounded_apart, unit_roundoff
from runtime.model.findings.shares import scalar_constant
from runtime.model.graph.ops import SCALES, WITHIN_ITS_INPUT
from runtime.model.graph.quantized import Quant, decoded
from runtime.model.graph.scopes import scopes
from runtime.model.read.model import label


def head_bound(hidden, table, chunk=1 << 24):
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


def bounds(olds, head_of, tables):
    """[{(hidden, table): _head_bound of that run's hidden vectors}] for each run of `olds`: each table read once
    for every run (a pass over a GiB table per feed set was most of the proof's own time)."""
    uses = {}
    for i, old in enumerate(olds):
        for hidden, table in sorted(set(head_of.values())):
            if hidden in old and old[hidden].size:
                uses.setdefault(table, []).append((i, hidden))
    found = [{} for _ in olds]
    for table, runs in uses.items():
        values = [olds[i][hidden] for i, hidden in runs]
        sums = head_bound(np.concatenate([v.reshape(-1, v.shape[-1]) for v in values]), tables[table])
        at = 0
        for (i, hidden), v in zip(runs, values):
            count = v.size // v.shape[-1]
            found[i][hidden, table] = sums[at:at + count].reshape(v.shape[:-1] + sums.shape[-1:])
            at += count
    return found


def nbits_bound(model, hidden, how, rows=4096):
    """Two MatMulNBits products of `hidden` [..., width] with the head `how` describes (retie.keep's: its Quant's
    fields, block_size, accuracy_level) lie each within runtime.bounds.quantized_head_bound of the exact sum over
    the decoded table, so within twice it of each other: [..., vocab], the table decoded `rows` tokens at a time."""
    q = Quant(**how["quant"])
    vectors = hidden.reshape(-1, hidden.shape[-1])
    vocab = model.tensors[q.codes].dims[0] if q.blocks else None
    if vocab is None or vectors.shape[-1] % max(1, how["block_size"]):
        return None  # not a layout bounded here: the comparison then asks for the bits
    parts = []
    for t0 in range(0, vocab, rows):
        table = decoded(model, q, t0, min(vocab, t0 + rows))
        if table is None:
            return None
        parts.append(quantized_head_bound(vectors, table[0], how["block_size"], how["accuracy_level"]))
    return 2 * np.concatenate(parts, axis=-1).reshape(hidden.shape[:-1] + (vocab,))


def nbits_bounds(model, runs, hidden, how):
    """nbits_bound of each run's `hidden` (None where a run has none), the table decoded once for all of them."""
    values = [run[hidden] if hidden in run and run[hidden].size else None for run in runs]
    present = [v for v in values if v is not None]
    if not present:
        return [None] * len(runs)
    flat = np.concatenate([v.reshape(-1, v.shape[-1]) for v in present])
    found = nbits_bound(model, flat, how)
    if found is None:
        return [None] * len(runs)
    at, bounds = 0, []
    for v in values:
        count = 0 if v is None else v.size // v.shape[-1]
        bounds.append(None if v is None else found[at:at + count].reshape(v.shape[:-1] + found.shape[-1:]))
        at += count
    return bounds


def last_position(run, names):
    """`run` with each value of `names` that has a position axis (rank 3 or more, the one before the last) cut to
    its last position: what a head that keeps one position gives, from the original's run."""
    return {k: v[..., -1:, :] if k in names and v.ndim >= 3 else v for k, v in run.items()}


ULPS_PER_OP = 8  # what one float32 elementwise op adds, each side: 1/2 ulp rounding, MLAS's Tanh a few more


def chains(model, head_of, walked=None):
    """{output: [(head output, Lipschitz constant, ops)]}: each output (a graph output, or the head's own) that a
    rewritten head's output reaches through elementwise ops whose change of their input is bounded by a constant
    factor: Div / Mul by a scalar constant (1/|c|, |c|), Add / Sub of a constant of any shape (1), Tanh, Identity
    and a Cast to float32 or float64 (1, and no op: it widens a float32, float16 or bfloat16 head's values exactly;
    a Cast to a narrower type ends the chain), as the soft-capped logits of Gemma2 (30 tanh(x / 30)) and the biased
    logits of BART and Marian are; from an If branch's output on through its If node's (both branches' heads then
    reach the same output: the run says which branch ran). `walked`: list(scopes(model.proto.graph)), where a
    caller asks more than once (one walk of the graphs for each)."""
    maps, branch_of, starts = {}, {}, []
    for path, body, order, producer, consumers in walked or scopes(model.proto.graph):
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
            if node.op_type in WITHIN_ITS_INPUT or (node.op_type == "Cast" and _to(node) in _WIDE):
                factor = 1.0
            elif node.op_type in ("Add", "Sub") and len(node.input) == 2 and name in node.input and \
                    _constant_tensor(node.input[1] if node.input[0] == name else node.input[0], producer, model):
                factor = 1.0  # a constant added, of any shape (BART's and Marian's final_logits_bias): the same on
                # both sides, so the difference passes unchanged, less the rounding ULPS_PER_OP counts
            elif node.op_type in SCALES and len(node.input) == 2 and name in node.input:
                other = node.input[1] if node.input[0] == name else node.input[0]
                c = scalar_constant(other, producer, model)
                if c is None or not np.isfinite(c) or (node.op_type == "Div" and (node.input[0] != name or c == 0)):
                    break
                factor = 1 / abs(c) if node.op_type == "Div" else abs(c) if node.op_type == "Mul" else 1.0
            else:
                break
            lipschitz, ops, name = lipschitz * factor, ops + (node.op_type != "Cast"), node.output[0]
    return found


_WIDE = (TensorProto.FLOAT, TensorProto.DOUBLE)  # a head's values (float32 at most) widened exactly


def _to(node):
    """A Cast's target type."""
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _constant_tensor(name, producer, model):
    """Whether `name` is an initializer of the main graph or a Constant node's output: the same in both runs."""
    node = producer.get(name)
    return name in model.tensors or (node is not None and node.op_type == "Constant")


def compare(old, new, head_of, chains, tables, bounds=None):
    """Failures comparing two runs' outputs: a head's, and what it reaches through a bounded chain (chains), within
    the head's bound (from `bounds`, bounds()' entry for this run, else computed here; _apart's for a float16 /
    bfloat16 head) times the chain's constant plus ULPS_PER_OP ulps per op on each side; the rest bit for bit (a
    head whose bound is neither given nor computable from `tables` too). Equal values always agree; NaN never."""
    failures = [f"output {name!r}: the original has none of that name" for name in new if name not in old]
    for name in (n for n in new if n in old):  # the original's also shows the hidden vectors the bound reads
        a, b = old[name], new[name]
        ran = [c for c in chains.get(name, []) if old[head_of[c[0]][0]].size]  # the heads whose branch ran
        if a.shape != b.shape or a.dtype != b.dtype:
            failures.append(f"output {name!r}: {a.shape} {a.dtype} became {b.shape} {b.dtype}")
        elif name in chains and not a.size:
            continue  # a value of the branch that did not run: both sides show it empty
        elif len(ran) == 1 and ((bounds or {}).get(head_of[ran[0][0]]) is not None or head_of[ran[0][0]][1] in tables):
            head, lipschitz, ops = ran[0]
            hidden, table = head_of[head]
            known = (bounds or {}).get((hidden, table))
            dot = head_bound(old[hidden], tables[table]) if known is None else known
            at_head = old.get(head, a) if old.get(head, a).shape == a.shape else a  # the head's own rounded values
            bound = lipschitz * _apart(dot, at_head)
            unit = max(unit_roundoff(a.dtype), unit_roundoff(at_head.dtype))  # an op rounds at most at the coarser
            bound += ops * ULPS_PER_OP * unit * (np.abs(a.astype(np.float64)) + np.abs(b.astype(np.float64)))
            apart = np.abs(a.astype(np.float64) - b.astype(np.float64))
            if np.isnan(b.astype(np.float64)).any() or not np.all((a == b) | (apart <= bound)):
                via = f" (through {ops} elementwise op(s) from the head, factor {lipschitz:g})" if ops else ""
                failures.append(f"output {name!r}: differs beyond {bound_words(at_head.dtype)}{via}")
        elif not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            failures.append(f"output {name!r}: not bit-identical, and not a head output whose bound is known")
    return failures


def _apart(dot, rounded):
    """How far two heads' outputs may lie apart: `dot` (their float32 sums' bound) where they are float32, else
    rounded_apart's for the narrower format of `rounded` (one side's values)."""
    name = np.dtype(rounded.dtype).name
    return rounded_apart(dot, rounded, name) if name in NARROW else dot


def heads_found(olds, news, chains):
    """What the proof saw of the outputs the heads reach (chains'): {"exact": whether every one was the original's
    bit for bit, "formats": the float formats of the heads' own outputs (a float16 head's logits widened to float32
    on the way out are float16's)}."""
    exact, formats = True, set()
    for old, new in zip(olds, news):
        for name in (n for n in chains if n in old and n in new):
            formats |= {np.dtype(old.get(head, old[name]).dtype).name for head, *_ in chains[name]}
            exact = exact and old[name].shape == new[name].shape and np.array_equal(
                np.ascontiguousarray(old[name]).view(np.uint8), np.ascontiguousarray(new[name]).view(np.uint8))
    return {"exact": exact, "formats": sorted(formats)}
