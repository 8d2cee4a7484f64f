"""The inputs a decoder is run on (inspect's retie proof and memory measurement, compare's copy test): a step
derived from the model and the files beside it, so a model with a sliding window or a short context can run at all.

plan() settles the shape in the parent, where the model's files are checked; feeds_for() makes the arrays in the
isolated child from that plan."""
import json

import numpy as np
from onnx import helper

from runtime.model.graph.ops import PLAIN_MATMULS
from runtime.model.read import sidecars

BATCH, SEQUENCE, PAST = 1, 3, 4  # the defaults; GroupQueryAttention wants batch 1 with a past

LENGTHS = (SEQUENCE, 1)  # new tokens per proof run: a prompt's worth, then one decoding step

SHORT_PASTS = (0, 3)  # one new token after these too: a kernel that multiplies one row may sum it another way

_WINDOW_ATTRIBUTES = ("local_window_size", "sliding_window", "window_size")  # GroupQueryAttention, others

FEEDS_MOST = 2**30  # the bytes a model's declared input shapes may make feeds_for allocate: an input of fixed shape
# [65536, 65536] is refused (NoFeeds through shaped_feeds), never 32 GiB allocated



def _count(value):
    """A positive int below sidecars.MOST, or None (what a config or attribute says is untrusted)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < sidecars.MOST else None


def _hints(model_path):
    """{windows, context, head_size} that genai_config.json and config.json beside the model declare."""
    windows, contexts = [], []
    genai = sidecars.genai_config(model_path) or {}
    section = genai.get("model") if isinstance(genai.get("model"), dict) else {}
    decoder = section.get("decoder") if isinstance(section.get("decoder"), dict) else {}
    window = decoder.get("sliding_window")
    windows.append(_count(window.get("window_size") if isinstance(window, dict) else window))
    contexts.append(_count(section.get("context_length")))
    try:
        config = json.loads(sidecars.read(model_path, "config.json") or b"null")
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        config = None
    if isinstance(config, dict):
        for key in ("sliding_window", "attention_chunk_size", "attention_sink_size", "sink_size"):
            windows.append(_count(config.get(key)))
        contexts.append(_count(config.get("max_position_embeddings")))
    return {"windows": [w for w in windows if w], "context": min(filter(None, contexts), default=None),
            "head_size": sidecars.genai_head_size(model_path), "genai": bool(decoder)}


def plan(model, model_path, past=None):
    """{past, lengths, steps, head_size, why, context}: the past length (at least every window the model's attention
    nodes or its config declare, unless `past` is given), the runs to make as [past, new tokens] (steps(), within
    the declared context; `lengths` their new-token counts) and the head size genai_config.json gives, for a
    checked Model's proto at `model_path`."""
    hints = _hints(model_path)
    windows = hints["windows"] + [_count(a.i) for node in model.graph.node for a in node.attribute
                                  if a.name in _WINDOW_ATTRIBUTES and a.type == a.INT and not a.ref_attr_name]
    windows = [w for w in windows if w]
    chosen = past if past is not None else max([PAST] + windows)
    why = (f"--proof-past {past}" if past is not None else
           f"a window of {max(windows)} declared" if windows and max(windows) > PAST else "the default")
    context = hints["context"]
    steps = [s for s in _steps(model, chosen, hints["genai"] and not windows, why == "the default")
             if context is None or sum(s) <= context] or [[chosen, 1]]
    return {"past": chosen, "lengths": sorted({n for _, n in steps}, reverse=True), "steps": steps,
            "head_size": hints["head_size"] or _attention_head_size(model), "why": why, "context": context}


def _steps(model, past, prompt_first, short):
    """[[past, new tokens]]: SEQUENCE new tokens after `past` (at past 0 where `prompt_first`: onnxruntime-genai's
    builder masks several new tokens only as a prompt, and genai feeds them so), then one after `past`; where `short`
    and the model's past length is a free dim, one new token after each of SHORT_PASTS as well."""
    steps = [[0 if prompt_first else past, SEQUENCE], [past, 1]]
    if short and _free_past(model):
        steps += [[p, 1] for p in SHORT_PASTS if [p, 1] not in steps]
    return steps


def _free_past(model):
    """Whether an input of the model is a past whose length is a named dim (a KV cache any length can fill)."""
    return any("past" in d.dim_param.lower() for v in model.graph.input if "past" in v.name
               for d in v.type.tensor_type.shape.dim if not d.HasField("dim_value"))


def _attention_head_size(model):
    """The head size a GroupQueryAttention node implies: the width of the projection feeding its query (MatMul,
    MatMulNBits or Gemm, past an Add of the bias) over its heads (num_heads, plus 2 kv_num_heads when Q, K and V come
    packed in one input); None where the graph does not say."""
    producer = {out: node for node in model.graph.node for out in node.output}
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or not node.input:
            continue
        attrs = {a.name: a.i for a in node.attribute if a.type == a.INT}
        heads = attrs.get("num_heads", 0) + (2 * attrs.get("kv_num_heads", 0) if len(node.input) < 2 or
                                             not node.input[1] else 0)
        source = producer.get(node.input[0])
        while source is not None and source.op_type == "Add":
            source = producer.get(source.input[0])
        width = None
        if source is not None and source.op_type == "MatMulNBits":
            width = next((a.i for a in source.attribute if a.name == "N"), None)
        elif source is not None and source.op_type in PLAIN_MATMULS and len(source.input) > 1:
            weight = dims.get(source.input[1], [])
            trans_b = any(a.name == "transB" and a.i for a in source.attribute)
            width = weight[0 if trans_b else -1] if len(weight) == 2 else None
        if width and heads > 0 and width % heads == 0:
            return _count(width // heads)
    return None


def steps(shape):
    """A plan()'s [[past, new tokens]] (one planned before steps were: its past, each of its lengths)."""
    return shape.get("steps") or [[shape["past"], n] for n in shape["lengths"]]


def describe(shape):
    """'3 new tokens after past 4 (the default); 1 after past 4, 0 and 3' for a plan()."""
    said, groups = False, {}
    for past, n in steps(shape):
        groups.setdefault(n, []).append(past)
    parts = []
    for n, pasts in groups.items():
        named = []
        for past in pasts:
            named.append(f"{past} ({shape['why']})" if past == shape["past"] and not said else str(past))
            said = said or past == shape["past"]
        pasts = ", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else named[0]
        parts.append(f"{n}{' new token' + ('s' if n != 1 else '') if not parts else ''} after past {pasts}")
    return "; ".join(parts)


def _dim(name, head_size, past, sequence):
    """A symbolic dim by its name, as exporters name them: batch, past / total sequence length, head size."""
    name = name.lower()
    if "batch" in name:
        return BATCH
    if "total" in name or "all" in name or "+" in name:  # Optimum: "past_sequence_length + sequence_length"
        return past + sequence
    if "past" in name:
        return past
    if "kv_cache" in name or "head" in name:
        return head_size
    return sequence


USE_CACHE_BRANCH = "use_cache_branch"  # a merged decoder's bool input: true reads the past, false is a first step


def no_past_branch(feeds):
    """`feeds` set for a merged decoder's branch that reads no past (USE_CACHE_BRANCH false, the first step's);
    a model without that input's feeds as they are."""
    if USE_CACHE_BRANCH in feeds:
        feeds[USE_CACHE_BRANCH] = np.zeros_like(feeds[USE_CACHE_BRANCH])
    return feeds


def feeds_for(model, rows, rng, head_size=None, past=PAST, sequence=SEQUENCE):
    """Inputs a decoder accepts: ids within the rows of the table each feeds (`rows`), attention_mask ones over
    past + new tokens, position_ids counting on from the past, past_key_values random of the right shapes
    (head size from the model's dims or `head_size`), other integers 1, other floats standard normal."""
    weights = {t.name for t in model.graph.initializer}
    fixed = [d.dim_value for v in model.graph.input if "past" in v.name for d in v.type.tensor_type.shape.dim[-1:]
             if d.HasField("dim_value")]
    head_size = head_size or (fixed[0] if fixed else SEQUENCE)
    has_past = any("past" in v.name for v in model.graph.input)
    feeds, total = {}, 0
    for value in model.graph.input:
        if value.name in weights:
            continue
        tensor_type = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else _dim(d.dim_param, head_size, past, sequence)
                 for d in tensor_type.shape.dim]
        dims = tensor_type.shape.dim
        if value.name == "attention_mask" and has_past and dims and not dims[-1].HasField("dim_value"):
            shape[-1] = past + sequence  # the mask covers the past too, whatever its dim is called (Optimum's merge)
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        total += int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
        if total > FEEDS_MOST:
            raise ValueError(f"input {value.name!r} of declared shape {shape}: the inputs would take over "
                             f"{FEEDS_MOST // 2**30} GiB")
        if value.name in rows:
            feeds[value.name] = rng.integers(0, rows[value.name], size=shape).astype(dtype)
        elif "position" in value.name and np.dtype(dtype).kind in "iu":
            feeds[value.name] = np.broadcast_to(np.arange(past, past + shape[-1]), shape).astype(dtype)
        elif np.dtype(dtype).kind in "iub":
            feeds[value.name] = np.ones(shape, dtype=dtype)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


class NoFeeds(ValueError):
    """The model's inputs cannot be fed: a type or shape no array of this machine has (one line says which)."""


def shaped_feeds(model, rows, shape, sequence, seed=0, past=None):
    """feeds_for at a plan()'s head size, `sequence` new tokens after `past` (None: the plan's past); NoFeeds naming
    the input that cannot be made (a map or optional input, a scalar position_ids, a negative or huge dimension)."""
    past = shape["past"] if past is None else past
    try:
        return feeds_for(model, rows, np.random.default_rng(seed), shape.get("head_size"), past, sequence)
    except (KeyError, IndexError, TypeError, ValueError, MemoryError, OverflowError) as e:
        raise NoFeeds(f"no feeds can be made for its inputs ({type(e).__name__}: {str(e)[:200] or 'no detail'})") \
            from None


def first_feeds(model, rows, shape):
    """shaped_feeds of a plan()'s first step: what a measuring run feeds."""
    past, sequence = steps(shape)[0]
    return shaped_feeds(model, rows, shape, sequence, past=past)
