"""The retie proof: both models run on the same random inputs; heads agree within float32's bound, the rest
bit for bit. It runs in the isolated child (runtime.inspect.isolated), since it opens sessions on an untrusted
model and runs onnx's shape inference on it."""
import os

import numpy as np
import onnx
from onnx import helper

from runtime.compare.bounds import gamma
from runtime.inspect.reading import load
from runtime.runner import Runner

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


def _outputs(path, hidden_names, feeds):
    """Every output of the model at `path`, and the hidden vectors the heads read, on `feeds`. Its tensor data is
    left to onnxruntime, read from the model's folder: one session at a time holds the model."""
    model = _with_outputs(onnx.load(path, load_external_data=False), hidden_names)
    session = Runner(model, data_folder=os.path.dirname(path)).session  # onnxruntime is the judge: contrib ops
    names = [o.name for o in session.get_outputs()]                      # are beyond the onnx checker
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


def prove(job):
    """One-line failures (empty: proven) for job {before, after, rewritten: [[output, hidden, table, transposed, now]],
    rows, folder}."""
    before = load(job["before"])
    flipped = {table: transposed for _, _, table, transposed, _ in job["rewritten"]}
    tables = {name: before.tensors[name].values().T if transposed else before.tensors[name].values()
              for name, transposed in flipped.items()}  # each [vocab, width], memory-mapped
    hidden_names = sorted({hidden for _, hidden, *_ in job["rewritten"] if hidden})  # None: no head rewritten
    feeds = feeds_for(before.proto, job["rows"], np.random.default_rng(0), job.get("head_size"))
    old = _outputs(job["before"], hidden_names, feeds)
    new = _outputs(job["after"], hidden_names, feeds)
    names = list(old)
    head_of = {output: (hidden, table) for output, hidden, table, *_ in job["rewritten"] if output}
    failures = []
    for name in names:
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            failures.append(f"output {name!r}: {a.shape} {a.dtype} became {b.shape} {b.dtype}")
        elif name in head_of:
            hidden, table = head_of[name]
            bound = _head_bound(old[hidden], tables[table])
            if np.isnan(b).any() or not np.all(np.abs(a.astype(np.float64) - b) <= bound):
                failures.append(f"output {name!r}: differs beyond 2 gamma_w sum|a b|")
        elif not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            failures.append(f"output {name!r}: not bit-identical, and not a head output whose bound is known")
    return failures
