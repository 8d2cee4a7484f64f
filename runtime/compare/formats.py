"""The lab at float16, bfloat16, int8 and int4: bytes, lookups to the bit, the tied head within float32's bound of
the decoded table, the stretch claim, and what each format does to the lab's answers (figures, not verdicts)."""
from typing import NamedTuple

import numpy as np

import graphs
from graphs import precision
from runtime.bounds import dot_bounds, quantized_head_bound
from runtime.compare.bounds import Check, differing, within
from runtime.resident import prepacked_copies, readers

QUERIES = 64  # neighbour lists compared with float32's for this many query tokens
ROWS = 4096  # past this vocabulary the reference quantizes a sample of rows (quantizing is row by row, so each
SAMPLE = 1024  # sampled row is exactly what the whole table would give): the ids, query, stretched token, and more


class _Format(NamedTuple):
    """One format of --format and its block size (None: one scale a row), as the checks of that format name it."""
    fmt: str
    block_size: int | None

    @property
    def tag(self):
        """The format as check names show it: "int8-b32", "float16"."""
        return self.fmt + (f"-b{self.block_size}" if self.block_size else "")


def reference_rows(config, reference):
    """The rows the pure-Python reference quantizes: all of them up to ROWS, else the ones the checks name plus
    evenly spaced others, SAMPLE in all."""
    if config.vocab <= ROWS:
        return list(range(config.vocab))
    named = set(config.ids) | {config.query, reference.stretch}
    spaced = np.linspace(0, config.vocab - 1, SAMPLE - len(named)).astype(int).tolist()
    return sorted(named | set(spaced))


def _stored_bytes(model, prefixes=("embedding",)):
    return sum(len(t.raw_data) for t in model.graph.initializer if t.name.startswith(prefixes))


def _held(sessions, name, vocab):
    """What a session holds of the table under onnxruntime's default SessionOptions: the optimized model's tensors
    with a row per token [(name, format name, bytes)], and each copy a kernel prepacks from one of them [(tensor,
    kernel, bytes, whether the original is freed: the kernel was its only reader)]."""
    optimized = sessions.optimized(name)
    tables = [t for t in optimized.graph.initializer if len(t.dims) > 1 and vocab in t.dims]
    held = [(t.name, precision.format_name(t.data_type), graphs.storage.raw_bytes(t.data_type, t.dims)) for t in tables]
    reading, names = readers(optimized), {t.name for t in tables}
    packed = [(p["initializer"], p["kernel"], p["bytes"], len(reading.get(p["initializer"], [])) == 1)
              for p in prepacked_copies(optimized) if p["initializer"] in names]
    return held, packed


def _accuracy_level(model):
    """The MatMulNBits head's accuracy level, or None for a head that decodes the table first."""
    levels = [a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "accuracy_level"]
    return levels[0] if levels else None


def check_formats(config, reference, sessions):
    """One block of checks and figures per format of --format other than float32 (float32 is every other check)."""
    found = []
    for fmt in config.formats:
        if fmt != "float32":
            found += _one_format(config, reference, sessions, _Format(fmt, config.block_for(fmt)))
    return found


def _one_format(config, reference, sessions, form):
    impl, (fmt, block_size), tag = reference.embed, form, form.tag
    ids, table32 = list(config.ids), reference.table32
    picked = reference_rows(config, reference)
    at = {row: i for i, row in enumerate(picked)}
    codes, scales = impl.quantize([reference.table[r] for r in picked], fmt, block_size)
    decoded = impl.dequantize(codes, scales, fmt, block_size)  # the truth at this format, for those rows
    models = {name: sessions.model_at(name, table32, fmt, block_size)
              for name in ("gather_lookup", "onehot_lookup", "tied_logits")}
    bytes_check, want = _bytes(config, reference, sessions, models, form)
    rows = [decoded[at[i]] for i in ids]
    bad = {name: differing(sessions.runner(f"{name}@{tag}", models[name]).run({"ids": [ids]})["embeddings"][0], rows)
           for name in ("gather_lookup", "onehot_lookup")}
    checks = [bytes_check, Check(
        "lookup", f"gather+onehot@{tag}", not any(bad.values()),
        f"Gather and OneHot+MatMul rows == embed.dequantize rows bit for bit ({bad['gather_lookup']} and "
        f"{bad['onehot_lookup']} of {len(rows) * config.width} differ)", float(any(bad.values())), 0.0,
        {"differing": bad}, claim="Gather and OneHot+MatMul rows == embed.dequantize's, bit for bit")]
    decoded64 = np.asarray(decoded, np.float64)
    head, logits, level = _head(config, reference, sessions, models["tied_logits"], decoded64, picked, form)
    checks += [head, _memory(sessions, f"tied_logits@{tag}", config.vocab, want)]
    stretch = reference.stretch
    checks.append(_stretch(config, reference, sessions, form, codes[at[stretch]], scales and scales[at[stretch]]))
    checks += _figures(config, reference, sessions, form, decoded64 - reference.table64[picked], logits, level)
    return checks


def _bytes(config, reference, sessions, models, form):
    """(the bytes check, table_bytes): the lookups' and tied head's initializers, and an untied head's, against
    embed.table_bytes."""
    (fmt, block_size), tag = form, form.tag
    vocab, width, table32 = config.vocab, config.width, reference.table32
    untied = graphs.untied_logits(sessions.stored(table32, fmt, block_size),
                                  precision.store(sessions.head32(), fmt, block_size), fmt=fmt, block_size=block_size,
                                  accuracy_level=config.accuracy_level)
    want, want_untied = (reference.embed.table_bytes(vocab, width, fmt, block_size, tied=t) for t in (True, False))
    stored = {name: _stored_bytes(m) for name, m in models.items()}
    held_untied = _stored_bytes(untied, ("embedding", "lm_head"))
    ok = all(v == want for v in stored.values()) and held_untied == want_untied
    call = f"table_bytes({vocab}, {width}, {fmt!r}" + (f", {block_size})" if block_size else ")")
    return Check("bytes", f"tables@{tag}", ok,
                 f"initializers hold {sorted(set(stored.values()))} bytes == table_bytes({vocab}, {width}, "
                 f"{fmt!r}, {block_size}) = {want}; untied {held_untied} == {want_untied}",
                 float(abs(held_untied - want_untied) + sum(abs(v - want) for v in stored.values())), 0.0,
                 {"table_bytes": want, "untied_bytes": want_untied},
                 claim=f"initializers hold {call} = {want} bytes"), want


def _head(config, reference, sessions, model, decoded64, picked, form):
    """(the tied head's check, its logits, its MatMulNBits accuracy level or None): logits against embed.logits of
    the decoded table, within that level's bound."""
    block_size, tag = form.block_size, form.tag
    logits = sessions.runner(f"tied_logits@{tag}", model).run(
        {"ids": [list(config.ids[:1])], "hidden": [reference.hidden]})["logits"][0]
    decoded = decoded64.tolist()
    exact = [reference.embed.logits(decoded, h) for h in reference.hidden]
    level = _accuracy_level(model)
    if level is None:  # DequantizeLinear of the whole table, then float32 products
        bound, how = dot_bounds(decoded64, reference.hidden), "DequantizeLinear + FusedMatMul, gamma_w sum|h t|"
    else:
        bound = quantized_head_bound(reference.hidden, decoded64, block_size, level)
        how = (f"MatMulNBits accuracy_level {level}, " + ("gamma_(w+2) sum|h t|" if level == 0 else
               f"the hidden vector as int8 per block of {block_size}: sum (s_b/2)|t| + gamma_(blocks+2) sum|h t|"))
    ok, diff, worst = within(logits[:, picked], exact, bound)
    sampled = "" if len(picked) == config.vocab else f" ({len(picked)} sampled rows)"
    return Check("head", f"tied_logits@{tag}", ok,
                 f"tied logits vs embed.logits(dequantized table, hidden){sampled} for {len(reference.hidden)} "
                 f"vectors ({how}), worst diff/bound {worst:.2f}", diff, float(np.max(bound)),
                 {"worst_ratio": worst, "accuracy_level": level},
                 claim="logits == embed.logits(dequantized) within the "
                       + ("float32" if level is None else f"accuracy_level {level}") + " bound"), logits, level


def _memory(sessions, name, vocab, want):
    """The INFO line of what a session on the tied head holds of the table (`want`: its bytes as stored)."""
    held, packed = _held(sessions, name, vocab)
    wider = [n for n, t, _ in held if t == "float32" and n != "embedding_scale"]
    line = "onnxruntime's optimized model holds " + ", ".join(f"{n} {t} {b} bytes" for n, t, b in held)
    if wider:
        line += " (a float32 copy besides the codes: the head's Cast is folded into a table; no half-precision MatMul on x86)"
    for tensor, kernel, size, freed in packed:
        line += (f"; at load {kernel} prepacks {size} bytes from {tensor}, "
                 + ("which is then freed (its only reader)" if freed else "which stays (the lookup reads it too)"))
    sizes = {n: b for n, _, b in held}
    total = sum(sizes.values()) + sum(size - (sizes[tensor] if freed else 0) for tensor, _, size, freed in packed)
    why = [r for r, found in (("a float32 copy", wider), ("prepacked buffers", packed)) if found]
    claim = f"a session holds {total} bytes of table: {total / want:.2f}x the {want} bytes stored"
    if total > want and why:  # the check above counts one table; these are the bytes kernels add to it
        claim = f"{total / want:.2f}x the table's {want} bytes held: {' + '.join(why)}"
    return Check("memory", name, None, line, values={"held": held, "prepacked": packed, "bytes_held": total},
                 info=True, claim=claim)


def _neighbors_at(reference, sessions, form, factor=None):
    """The session of the cosine neighbors graph on the table stored in `form` (with the stretched row times
    `factor`, if given, re-quantized alone), built once."""
    fmt, block_size = form
    name = f"neighbors_cosine@{fmt}-{block_size}" + (f"x{factor:g}" if factor else "")
    if name not in sessions.runners:
        table = sessions.stored(reference.table32, fmt, block_size)
        if factor:
            table = table.with_row(reference.stretch, reference.table32[reference.stretch] * np.float32(factor))
        return sessions.runner(name, graphs.neighbors(table, "cosine", fmt=fmt, block_size=block_size))
    return sessions.runners[name]


def _stretch(config, reference, sessions, form, codes, scales):
    """A power-of-two stretch of one row: the stored row scales exactly (int8 / int4: the scales absorb it, the codes
    stay), so the cosine neighbor list the graph gives is unchanged. `codes`, `scales`: that row as quantized."""
    (fmt, block_size), tag = form, form.tag
    token, factor = reference.stretch, 2.0 ** max(1, int(np.log2(reference.factor)))
    row = [v * factor for v in reference.table[token]]
    new_codes, new_scales = reference.embed.quantize([row], fmt, block_size)
    if scales is None:
        moved = new_codes[0] != [c * factor for c in codes]
    else:
        moved = new_codes[0] != codes or new_scales[0] != [s * factor for s in scales]
    before = _neighbors_at(reference, sessions, form)
    after = _neighbors_at(reference, sessions, form, factor)
    feeds = {"ids": [config.query], "k": [config.k]}
    a, b = before.run(feeds)["indices"][0].tolist(), after.run(feeds)["indices"][0].tolist()
    what = "codes unchanged, scales x" if scales is not None else "codes x"
    changed = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
    kept = f"scales x{factor:g}, codes kept" if scales is not None else f"codes x{factor:g} exactly"
    return Check("stretch", f"neighbors@{tag}", not moved and a == b,
                 f"row {token} x{factor:g}: {what}{factor:g} exactly: {not moved}; cosine {config.listed()} of token "
                 f"{config.query} unchanged: {a == b} ({changed} positions differ, exact list comparison)",
                 float(changed + moved), 0.0, {"before": a, "after": b},
                 claim=f"row {token} x{factor:g}: {kept}; token {config.query}'s cosine list unchanged")


def _figures(config, reference, sessions, form, value_errors, logits, level):
    """What the format does to the lab's answers: neighbor lists against float32's, and the head's logits."""
    (fmt, block_size), tag = form, form.tag
    rng = np.random.default_rng(config.seed & (2**64 - 1))  # any seed the table takes, negative too (as make_table)
    queries = rng.choice(config.vocab, size=min(QUERIES, config.vocab), replace=False)
    k = min(config.k, config.vocab - 1)
    feeds = {"ids": queries, "k": [k]}
    base = sessions.cached(("figures", "neighbors", k),  # the float32 graph the float32 checks ran, once for all
                           lambda: sessions.runner("neighbors_cosine").run(feeds)["indices"])
    here = sessions.runners[f"neighbors_cosine@{fmt}-{block_size}"].run(feeds)["indices"]
    overlap = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(base.tolist(), here.tolist())])) if k else 1.0
    full = sessions.cached(("figures", "logits"), lambda: sessions.runner("tied_logits").run(
        {"ids": [list(config.ids[:1])], "hidden": [reference.hidden]})["logits"][0])
    scale = float(np.max(np.abs(full)))
    heads = {None: logits} if level is None else {level: logits}
    if level is not None:  # the other accuracy level too, to show what each costs in accuracy
        for other in precision.ACCURACY_LEVELS:
            if other != level:
                model = graphs.tied_logits(sessions.stored(reference.table32, fmt, block_size), fmt=fmt,
                                           block_size=block_size, accuracy_level=other)
                heads[other] = sessions.runner(f"tied_logits@{tag}-level{other}", model).run(
                    {"ids": [list(config.ids[:1])], "hidden": [reference.hidden]})["logits"][0]
    top = lambda x: [set(np.argsort(-row, kind="stable")[:k].tolist()) for row in x]
    parts, values = [], {"neighbor_overlap": overlap}
    for at, got in sorted(heads.items(), key=lambda item: -1 if item[0] is None else item[0]):
        error = float(np.max(np.abs(got.astype(np.float64) - full)))
        agree = float(np.mean([len(a & b) / k for a, b in zip(top(got), top(full))])) if k else 1.0
        name = "the head" if at is None else f"accuracy_level {at}"
        parts.append(f"{name}: top-{k} logits overlap {agree:.1%}, largest logit error {error:.3g} "
                     f"({error / scale:.2%} of the largest |logit|)")
        values[f"level{at}" if at is not None else "head"] = {"logit_error": error, "logit_error_relative": error / scale,
                                                              "top_k_overlap": agree}
    table_error = float(np.max(np.abs(value_errors)))
    values["value_error"] = table_error
    mine = values["head" if level is None else f"level{level}"]
    claim = (f"vs float32: {k} nearest {overlap:.1%} kept ({len(queries)} queries), max logit error "
             f"{mine['logit_error_relative']:.2%}")
    return [Check("figures", f"{tag}", None,
                  f"cosine top-{k} overlap with float32 over {len(queries)} queries {overlap:.1%}; against the float32 "
                  f"head for {len(reference.hidden)} hidden vectors, " + "; ".join(parts)
                  + f"; largest value error {table_error:.3g}", values=values, info=True, claim=claim)]
