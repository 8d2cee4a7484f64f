"""The retie proof: both models run on the same random inputs; heads agree within float32's bound, the rest
bit for bit. It runs in the isolated child (runtime.inspect.isolated), since it opens sessions on an untrusted
model and runs onnx's shape inference on it."""
import os

import numpy as np
import onnx
from onnx import helper, numpy_helper

import graphs
from runtime.runner import Runner

U = 2.0**-24


BATCH, SEQUENCE, PAST = 1, 3, 4  # symbolic dims, resolved once for every input (GroupQueryAttention wants batch 1 with a past)


def _dim(name, head_size):
    """A symbolic dim by its name, as exporters name them: batch, past / total sequence length, head size."""
    name = name.lower()
    if "batch" in name:
        return BATCH
    if "total" in name or "all" in name or "+" in name:  # Optimum: "past_sequence_length + sequence_length"
        return PAST + SEQUENCE
    if "past" in name:
        return PAST
    if "kv_cache" in name or "head" in name:
        return head_size
    return SEQUENCE


def feeds_for(model, rows, rng, head_size=None):
    """Inputs a decoder accepts: ids within the rows of the table each feeds (`rows`), attention_mask ones over
    past + new tokens, position_ids counting on from the past, past_key_values random of the right shapes
    (head size from the model's dims or `head_size`), other integers 1, other floats standard normal."""
    weights = {t.name for t in model.graph.initializer}
    fixed = [d.dim_value for v in model.graph.input if "past" in v.name for d in v.type.tensor_type.shape.dim[-1:]
             if d.HasField("dim_value")]
    head_size = head_size or (fixed[0] if fixed else SEQUENCE)
    feeds = {}
    for value in model.graph.input:
        if value.name in weights:
            continue
        tensor_type = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else _dim(d.dim_param, head_size) for d in tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if value.name in rows:
            feeds[value.name] = rng.integers(0, rows[value.name], size=shape).astype(dtype)
        elif "position" in value.name and np.dtype(dtype).kind in "iu":
            feeds[value.name] = np.broadcast_to(np.arange(PAST, PAST + shape[-1]), shape).astype(dtype)
        elif np.dtype(dtype).kind in "iub":
            feeds[value.name] = np.ones(shape, dtype=dtype)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


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


def prove(job):
    """One-line failures (empty: proven) for job {before, after, rewritten: [[output, hidden, table, transposed, now]],
    rows, folder}."""
    before, after = onnx.load(job["before"]), onnx.load(job["after"])
    flipped = {table: transposed for _, _, table, transposed, _ in job["rewritten"]}
    tables = {t.name: numpy_helper.to_array(t).T if flipped[t.name] else numpy_helper.to_array(t)
              for t in before.graph.initializer if t.name in flipped}  # each [vocab, width]
    hidden_names = sorted({hidden for _, hidden, *_ in job["rewritten"] if hidden})  # None: no head rewritten
    sessions = []
    for label, model in (("before", before), ("after", after)):
        path = os.path.join(job["folder"], f"proof_{label}.onnx")
        graphs.save(_with_outputs(model, hidden_names), path, overwrite=True, check=False)  # onnxruntime is the judge: contrib ops are beyond the onnx checker
        sessions.append(Runner(path).session)
    feeds = feeds_for(before, job["rows"], np.random.default_rng(0), job.get("head_size"))
    names = [o.name for o in sessions[0].get_outputs()]
    old, new = (dict(zip(names, s.run(names, feeds))) for s in sessions)
    head_of = {output: (hidden, table) for output, hidden, table, *_ in job["rewritten"] if output}
    failures = []
    for name in names:
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            failures.append(f"output {name!r}: {a.shape} {a.dtype} became {b.shape} {b.dtype}")
        elif name in head_of:
            hidden, table = head_of[name]
            h, t = np.abs(old[hidden].astype(np.float64)), np.abs(tables[table].astype(np.float64))
            width = t.shape[1]
            bound = 2 * width * U / (1 - width * U) * (h @ t.T)  # both sides within gamma_w sum|a b| of exact
            if np.isnan(b).any() or not np.all(np.abs(a.astype(np.float64) - b) <= bound):
                failures.append(f"output {name!r}: differs beyond 2 gamma_w sum|a b|")
        elif not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            failures.append(f"output {name!r}: not bit-identical, and not a head output whose bound is known")
    return failures
