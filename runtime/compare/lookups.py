"""Lookups, held to the bit: the table itself, Gather, OneHot + MatMul, and the sqrt(width) scaling."""
import math

import numpy as np
from onnx import numpy_helper

from runtime.bounds import as64
from runtime.compare.bounds import Check, differing, scaled_tolerances, within


ONEHOT_CLAIM = "OneHot+MatMul == embed.onehot_lookup == Gather, bit for bit"  # the generated and the real table's


def check_table(config, reference, sessions):
    model = sessions.model("gather_lookup")
    tensor = [t for t in model.graph.initializer if t.name == "embedding"][0]
    values = numpy_helper.to_array(tensor)
    bad = differing(values, reference.table64)
    count = reference.embed.param_count(config.vocab, config.width)
    ok = bad == 0 and values.size == count
    return [Check("table", "gather_lookup", ok,
                  f"'embedding' == embed.make_table({config.vocab}, {config.width}, {config.seed}) bit for bit: "
                  f"{bad} of {values.size} values differ; {values.size} values, param_count {count}",
                  0.0 if bad == 0 else 1.0, 0.0, {"differing": bad, "elements": int(values.size), "param_count": count},
                  claim=f"'embedding' == embed.make_table({config.vocab}, {config.width}, {config.seed}), bit for bit")]


def check_gather(config, reference, sessions):
    ids = list(config.ids)
    out = sessions.runner("gather_lookup").run({"ids": [ids]})["embeddings"][0]  # (n, width)
    bad = differing(out, reference.lookup(ids))
    repeats = {i for i in ids if ids.count(i) > 1}
    same = all(differing(out[p], out[ids.index(i)]) == 0 for p, i in enumerate(ids))
    note = (f"repeated id{'s' if len(repeats) > 1 else ''} {sorted(repeats)}: same vector at every position: {same}"
            if repeats else "no repeated id in --ids")
    return [Check("lookup", "gather_lookup", bad == 0 and same,
                  f"Gather(ids={ids}) == embed.lookup bit for bit ({bad} of {out.size} differ); {note}",
                  float(bad > 0), 0.0, {"differing": bad, "repeats_identical": same},
                  claim="Gather == embed.lookup, bit for bit" + ("; a repeated id gives one row" if repeats else ""))]


def check_onehot(config, reference, sessions):
    ids, vocab, width = list(config.ids), config.vocab, config.width
    model = sessions.model("onehot_lookup")
    out = sessions.runner("onehot_lookup").run({"ids": [ids]})["embeddings"][0]
    gathered = sessions.runner("gather_lookup").run({"ids": [ids]})["embeddings"][0]
    bad_ref, bad_gather = differing(out, reference.onehot(ids)), differing(out, gathered)
    # MatMul([n, vocab] one-hot, [vocab, width] table): n * vocab * width products, counted from the graph
    hot_dims = {v.name: v.type.tensor_type.shape.dim for v in model.graph.value_info}["one_hot"]
    graph_products = len(ids) * hot_dims[-1].dim_value * width
    expected = len(ids) * vocab * width
    ok = bad_ref == 0 and bad_gather == 0 and graph_products == expected
    return [Check("onehot_lookup", "onehot_lookup", ok,
                  f"OneHot+MatMul == embed.onehot_lookup ({bad_ref} differ) == Gather ({bad_gather} differ), bit "
                  f"for bit; multiplications: Gather 0, one-hot {graph_products} = {len(ids)}x{vocab}x{width} (ids x vocab x "
                  "width)", float(bad_ref + bad_gather > 0), 0.0,
                  {"multiplications_gather": 0, "multiplications_onehot": graph_products},
                  claim=ONEHOT_CLAIM)]


def check_scaled(config, reference, sessions):
    impl, width = reference.embed, config.width
    out = as64(sessions.runner("scaled_lookup").run({"ids": [list(config.ids)]})["embeddings"][0])
    rows = reference.lookup(config.ids)
    scaled = as64(impl.scale_sqrt_d(rows))  # the scale depends on the width alone: the rows are enough
    rows = as64(rows)
    root = math.sqrt(width)
    value_tol, ratio_tol, cos_tol = scaled_tolerances(width)
    ok_values, diff, worst = within(out, scaled, value_tol * np.abs(scaled))
    ratios = np.array([impl.norm(o) / impl.norm(r) for o, r in zip(out, rows)])
    cosines = np.array([impl.cosine(o, r) for o, r in zip(out, rows)])
    ok = ok_values and bool(np.all(np.abs(ratios - root) <= ratio_tol)) and bool(np.all(np.abs(cosines - 1) <= cos_tol))
    return [Check("scaled", "scaled_lookup", ok,
                  f"values == embed.scale_sqrt_d within 2u relative (worst {worst:.2f}); norm ratio "
                  f"{ratios.min():.9f}..{ratios.max():.9f} vs sqrt({width}) = {root:.9f} (tolerance "
                  f"{ratio_tol:.2g})", float(np.max(np.abs(cosines - 1))), cos_tol,
                  {"norm_ratios": ratios.tolist(), "cosines": cosines.tolist(), "diff_is": "max |cosine - 1|"},
                  claim=f"== embed.scale_sqrt_d within 2u: norms x sqrt({width}), directions kept")]
