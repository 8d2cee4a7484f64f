"""The lab at float16, bfloat16, int8 and int4: bytes, lookups to the bit, the tied head within float32's bound of
the decoded table, the stretch claim, and what each format does to the lab's answers (figures, not verdicts)."""
import numpy as np

import embed
import graphs
from graphs import precision
from runtime.compare.bounds import Check, differing, dot_bounds, within

QUERIES = 64  # neighbour lists compared with float32's for this many query tokens
ROWS = 4096  # past this vocabulary the reference quantizes a sample of rows (quantizing is row by row, so each
SAMPLE = 1024  # sampled row is exactly what the whole table would give): the ids, query, stretched token, and more


def reference_rows(lab):
    """The rows the pure-Python reference quantizes: all of them up to ROWS, else the ones the checks name plus
    evenly spaced others, SAMPLE in all."""
    if lab.vocab <= ROWS:
        return list(range(lab.vocab))
    named = set(lab.ids) | {lab.query, lab.stretch}
    spaced = np.linspace(0, lab.vocab - 1, SAMPLE - len(named)).astype(int).tolist()
    return sorted(named | set(spaced))


def _stored_bytes(model, prefixes=("embedding",)):
    return sum(len(t.raw_data) for t in model.graph.initializer if t.name.startswith(prefixes))


def _copies(lab, name, vocab, width):
    """The vocab x width tensors of onnxruntime's optimized model, as (type name, bytes)."""
    optimized = lab.optimized(name)
    return [(_type_name(t.data_type), graphs.storage.raw_bytes(t.data_type, t.dims)) for t in optimized.graph.initializer
            if sorted(t.dims) == sorted([vocab, width])]


def _type_name(data_type):
    return {v: k for k, v in precision.ONNX_TYPE.items()}.get(data_type, str(data_type))


def check_formats(lab):
    """One block of checks and figures per format of --format other than float32 (float32 is every other check)."""
    found = []
    for fmt in lab.formats:
        if fmt != "float32":
            found += _one_format(lab, fmt, lab.block_size if fmt in ("int8", "int4") else None)
    return found


def _one_format(lab, fmt, block_size):
    vocab, width, tag = lab.vocab, lab.width, fmt + (f"-b{block_size}" if block_size else "")
    picked = reference_rows(lab)
    at = {row: i for i, row in enumerate(picked)}
    lab.progress(f"embed.quantize({fmt}) and dequantize of {len(picked)} rows in pure Python")
    codes, scales = embed.quantize([lab.table[r] for r in picked], fmt, block_size)
    reference = embed.dequantize(codes, scales, fmt, block_size)  # the truth at this format, for those rows
    reference64 = np.asarray(reference, np.float64)
    sampled = "" if len(picked) == vocab else f" ({len(picked)} sampled rows)"
    graph = lambda name: f"{name}@{tag}"
    lab.progress(f"{fmt}: building the lookups and heads")
    models = {name: lab.model_at(name, fmt, block_size) for name in ("gather_lookup", "onehot_lookup", "tied_logits")}
    untied = graphs.untied_logits(lab.stored(fmt, block_size), precision.store(lab.head32(), fmt, block_size),
                                  fmt=fmt, block_size=block_size)
    checks = []

    want, want_untied = (embed.table_bytes(vocab, width, fmt, block_size, tied=t) for t in (True, False))
    stored = {name: _stored_bytes(m) for name, m in models.items()}
    held_untied = _stored_bytes(untied, ("embedding", "lm_head"))
    ok = all(v == want for v in stored.values()) and held_untied == want_untied
    checks.append(Check("bytes", graph("tables"), ok,
                        f"initializers hold {sorted(set(stored.values()))} bytes == table_bytes({vocab}, {width}, "
                        f"{fmt!r}, {block_size}) = {want}; untied {held_untied} == {want_untied}",
                        float(abs(held_untied - want_untied) + sum(abs(v - want) for v in stored.values())), 0.0,
                        {"table_bytes": want, "untied_bytes": want_untied}))

    lab.progress(f"{fmt}: running the lookups")
    rows = [reference[at[i]] for i in lab.ids]
    bad = {name: differing(lab.runner(graph(name), models[name]).run({"ids": [lab.ids]})["embeddings"][0], rows)
           for name in ("gather_lookup", "onehot_lookup")}
    checks.append(Check("lookup", graph("gather+onehot"), not any(bad.values()),
                        f"Gather and OneHot+MatMul rows == embed.dequantize rows bit for bit ({bad['gather_lookup']} "
                        f"and {bad['onehot_lookup']} of {len(rows) * width} differ)", float(any(bad.values())), 0.0,
                        {"differing": bad}))

    lab.progress(f"{fmt}: the tied head and its reference")
    tied = lab.runner(graph("tied_logits"), models["tied_logits"])
    logits = tied.run({"ids": [lab.ids[:1]], "hidden": [lab.hidden]})["logits"][0]
    exact = [embed.logits(reference, h) for h in lab.hidden]
    bound = dot_bounds(reference64, lab.hidden)
    ok, diff, worst = within(logits[:, picked], exact, bound)
    lab.progress(f"{fmt}: onnxruntime's optimized tied head")
    copies = _copies(lab, graph("tied_logits"), vocab, width)
    checks.append(Check("head", graph("tied_logits"), ok,
                        f"tied logits vs embed.logits(dequantized table, hidden){sampled} for {len(lab.hidden)} "
                        f"vectors, worst "
                        f"diff/bound {worst:.2f}", diff, float(np.max(bound)), {"worst_ratio": worst}))
    wider = [c for c in copies if c[0] != fmt]
    checks.append(Check("memory", graph("tied_logits"), None, f"onnxruntime's optimized model holds "
                        + ", ".join(f"{t} {b} bytes" for t, b in copies)
                        + (" (a float32 copy besides the codes: the head's Cast is folded into a table; the "
                           "CPU provider has no half-precision MatMul on x86)" if wider else " (the codes once)"),
                        values={"copies": copies, "figure": True}))

    lab.progress(f"{fmt}: the stretch and the neighbour lists")
    checks.append(_stretch(lab, fmt, block_size, codes[at[lab.stretch]], scales and scales[at[lab.stretch]], tag))
    checks += _figures(lab, fmt, block_size, reference64 - lab.table64[picked], logits, tag)
    return checks


def _stretch(lab, fmt, block_size, codes, scales, tag):
    """A power-of-two stretch of one row: the stored row scales exactly (int8 / int4: the scales absorb it, the codes
    stay), so the cosine neighbour list the graph gives is unchanged. `codes`, `scales`: that row as quantized."""
    token, factor = lab.stretch, 2.0 ** max(1, int(np.log2(lab.factor)))
    row = [v * factor for v in lab.table[token]]
    new_codes, new_scales = embed.quantize([row], fmt, block_size)
    if scales is None:
        moved = new_codes[0] != [c * factor for c in codes]
    else:
        moved = new_codes[0] != codes or new_scales[0] != [s * factor for s in scales]
    before, after = lab.neighbors_at(fmt, block_size), lab.neighbors_at(fmt, block_size, factor)
    feeds = {"ids": [lab.query], "k": [lab.k]}
    a, b = before.run(feeds)["indices"][0].tolist(), after.run(feeds)["indices"][0].tolist()
    what = "codes unchanged, scales x" if scales is not None else "codes x"
    return Check("stretch", f"neighbors@{tag}", not moved and a == b,
                 f"row {token} x{factor:g}: {what}{factor:g} exactly: {not moved}; cosine top {lab.k} of token "
                 f"{lab.query} unchanged: {a == b}", None, None, {"before": a, "after": b})


def _figures(lab, fmt, block_size, value_errors, logits, tag):
    """What the format does to the lab's answers: neighbour lists against float32's, and the head's logits."""
    rng = np.random.default_rng(lab.seed)
    queries = rng.choice(lab.vocab, size=min(QUERIES, lab.vocab), replace=False)
    k = min(lab.k, lab.vocab - 1)
    feeds = {"ids": queries, "k": [k]}
    base = lab.memo(("figures", "neighbors", k),  # the float32 graph the float32 checks ran, once for every format
                    lambda: lab.runner("neighbors_cosine").run(feeds)["indices"])
    here = lab.neighbors_at(fmt, block_size).run(feeds)["indices"]
    overlap = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(base.tolist(), here.tolist())])) if k else 1.0
    full = lab.memo(("figures", "logits"), lambda: lab.runner("tied_logits").run(
        {"ids": [lab.ids[:1]], "hidden": [lab.hidden]})["logits"][0])
    error = float(np.max(np.abs(logits.astype(np.float64) - full)))
    scale = float(np.max(np.abs(full)))
    table_error = float(np.max(np.abs(value_errors)))
    return [Check("figures", f"{tag}", None,
                  f"cosine top-{k} overlap with float32 over {len(queries)} queries {overlap:.1%}; largest logit "
                  f"error vs the float32 head {error:.3g} ({error / scale:.2%} of the largest |logit|); largest "
                  f"value error {table_error:.3g}",
                  values={"figure": True, "neighbour_overlap": overlap, "logit_error": error,
                          "logit_error_relative": error / scale, "value_error": table_error})]
