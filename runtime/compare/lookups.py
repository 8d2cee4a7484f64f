"""Lookups, held to the bit: the table itself, Gather, OneHot + MatMul, and the sqrt(width) scaling."""
import math

import numpy as np
from onnx import numpy_helper

import embed
from runtime.compare.bounds import U, U64, Check, as64, differing, within


def check_table(lab):
    model = lab.model("gather_lookup")
    tensor = [t for t in model.graph.initializer if t.name == "embedding"][0]
    values = numpy_helper.to_array(tensor)
    bad = differing(values, lab.table64)
    count = embed.param_count(lab.vocab, lab.width)
    ok = bad == 0 and values.size == count
    return [Check("table", "gather_lookup", ok,
                  f"'embedding' == embed.make_table({lab.vocab}, {lab.width}, {lab.seed}) bit for bit: "
                  f"{bad} of {values.size} values differ; {values.size} values, param_count {count}",
                  0.0 if bad == 0 else 1.0, 0.0, {"differing": bad, "elements": int(values.size), "param_count": count})]


def check_gather(lab):
    out = lab.runner("gather_lookup").run({"ids": [lab.ids]})["embeddings"][0]  # (n, width)
    bad = differing(out, embed.lookup(lab.table, lab.ids))
    repeats = {i for i in lab.ids if lab.ids.count(i) > 1}
    same = all(differing(out[p], out[lab.ids.index(i)]) == 0 for p, i in enumerate(lab.ids))
    note = (f"repeated id{'s' if len(repeats) > 1 else ''} {sorted(repeats)}: same vector at every position: {same}"
            if repeats else "no repeated id in --ids")
    return [Check("lookup", "gather_lookup", bad == 0 and same,
                  f"Gather(ids={lab.ids}) == embed.lookup bit for bit ({bad} of {out.size} differ); {note}",
                  float(bad > 0), 0.0, {"differing": bad, "repeats_identical": same})]


def check_onehot(lab):
    model = lab.model("onehot_lookup")
    out = lab.runner("onehot_lookup").run({"ids": [lab.ids]})["embeddings"][0]
    gathered = lab.runner("gather_lookup").run({"ids": [lab.ids]})["embeddings"][0]
    lab.progress(f"embed.onehot_lookup: {len(set(lab.ids))} x {lab.vocab} x {lab.width} multiplications in pure Python")
    reference = lab.onehot()
    bad_ref, bad_gather = differing(out, reference), differing(out, gathered)
    # MatMul([n, vocab] one-hot, [vocab, width] table): n * vocab * width products, counted from the graph
    hot_dims = {v.name: v.type.tensor_type.shape.dim for v in model.graph.value_info}["one_hot"]
    graph_products = len(lab.ids) * hot_dims[-1].dim_value * lab.width
    expected = len(lab.ids) * lab.vocab * lab.width
    ok = bad_ref == 0 and bad_gather == 0 and graph_products == expected
    return [Check("onehot_lookup", "onehot_lookup", ok,
                  f"OneHot+MatMul == embed.onehot_lookup ({bad_ref} differ) == Gather ({bad_gather} differ), bit "
                  f"for bit; multiplications: Gather 0, one-hot {graph_products} = {len(lab.ids)}x{lab.vocab}x"
                  f"{lab.width}", float(bad_ref + bad_gather > 0), 0.0,
                  {"multiplications_gather": 0, "multiplications_onehot": graph_products})]


def check_scaled(lab):
    out = as64(lab.runner("scaled_lookup").run({"ids": [lab.ids]})["embeddings"][0])
    rows = embed.lookup(lab.table, lab.ids)
    reference = as64(embed.scale_sqrt_d(rows))  # the scale depends on the width alone: the rows are enough
    rows = as64(rows)
    root = math.sqrt(lab.width)
    # float32(sqrt(w)) and the product: two roundings of at most u each, relative
    ok_values, diff, worst = within(out, reference, 2 * U * (1 + U) * np.abs(reference))
    ratios = np.array([embed.norm(o) / embed.norm(r) for o, r in zip(out, rows)])
    ratio_tol = root * (2 * U * (1 + U) + (lab.width + 4) * U64)
    cosines = np.array([embed.cosine(o, r) for o, r in zip(out, rows)])
    cos_tol = 2 * U * U + (lab.width + 4) * U64  # values off by <= 2u relative turn a cosine by <= (2u)^2 / 2
    ok = ok_values and bool(np.all(np.abs(ratios - root) <= ratio_tol)) and bool(np.all(np.abs(cosines - 1) <= cos_tol))
    return [Check("scaled", "scaled_lookup", ok,
                  f"values == embed.scale_sqrt_d within 2u relative (worst {worst:.2f}); norm ratio "
                  f"{ratios.min():.9f}..{ratios.max():.9f} vs sqrt({lab.width}) = {root:.9f} (tolerance "
                  f"{ratio_tol:.2g})", float(np.max(np.abs(cosines - 1))), cos_tol,
                  {"norm_ratios": ratios.tolist(), "cosines": cosines.tolist(), "diff_is": "max |cosine - 1|"})]
