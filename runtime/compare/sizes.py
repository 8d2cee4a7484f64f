"""Sizes: values held against embed.param_count, and bytes on disk split into tensor data and layout."""
import math
import os

import onnx
from onnx import TensorProto

import embed
import graphs
from graphs.storage import data_path
from runtime.compare.bounds import Check


def saved_bytes(path, table_dims=None):
    """(tensor data bytes, file bytes) of a saved model: tensor data read from each initializer as stored
    (inline raw data, or the length of its external range), only of initializers of `table_dims` if given (the
    tables, not the shape constants beside them); everything else in the files is layout (names, docs, small
    constants, protobuf framing, alignment padding between external tensors)."""
    model = onnx.load(path, load_external_data=False)
    tensors = 0
    for tensor in model.graph.initializer:
        if table_dims is not None and list(tensor.dims) != list(table_dims):
            continue
        if tensor.data_location == TensorProto.EXTERNAL:
            tensors += int({e.key: e.value for e in tensor.external_data}["length"])
        else:
            tensors += len(tensor.raw_data)
    files = os.path.getsize(path) + (os.path.getsize(data_path(path)) if os.path.exists(data_path(path)) else 0)
    return tensors, files


def check_sizes(lab):
    """Tied and untied heads at vocab V and the tied head at 2V, built by graphs and saved as graphs.save writes
    them: untying adds one table, doubling the vocabulary adds its rows. `lab` needs only vocab, width, seed,
    folder and progress, so this check can run in the second process."""
    table_bytes = 4 * lab.vocab * lab.width
    lab.progress(f"sizes: tied and untied at vocab {lab.vocab} and {2 * lab.vocab}, saved to disk")
    sizes = {}
    doubled = graphs.make_table(2 * lab.vocab, lab.width, lab.seed)
    head = graphs.make_table(lab.vocab, lab.width, lab.seed + 1)
    for vocab in (lab.vocab, 2 * lab.vocab):
        table = doubled[:vocab]  # a row never depends on the vocabulary size
        for tied in (True, False) if vocab == lab.vocab else (True,):  # an untied 2V model would add nothing
            model = graphs.tied_logits(table) if tied else graphs.untied_logits(table, head)
            counted = sum(math.prod(t.dims) for t in model.graph.initializer if list(t.dims) == [vocab, lab.width])
            path = os.path.join(lab.folder, f"sizes_{vocab}_{'tied' if tied else 'untied'}.onnx")
            graphs.save(model, path, overwrite=True, check=False)  # the builders checked these models
            sizes[vocab, tied] = (counted, *saved_bytes(path, [vocab, lab.width]))
            del model
    checks = []
    for label, (a, b), claim in (("untied - tied", ((lab.vocab, True), (lab.vocab, False)), "a second table"),
                                 ("tied, vocab x2", ((lab.vocab, True), (2 * lab.vocab, True)), "the added rows")):
        extra_values = sizes[b][0] - sizes[a][0]
        extra_tensor, extra_layout = sizes[b][1] - sizes[a][1], (sizes[b][2] - sizes[b][1]) - (sizes[a][2] - sizes[a][1])
        ok = extra_values == lab.vocab * lab.width and extra_tensor == table_bytes
        checks.append(Check("sizes", "tied/untied", ok,
                            f"{label}: +{extra_values} values, tensor data +{extra_tensor} bytes = {claim} "
                            f"({table_bytes} bytes); layout (names, docs, shape constants, framing, alignment) {extra_layout:+d} bytes, "
                            f"on disk +{sizes[b][2] - sizes[a][2]} bytes",
                            float(abs(extra_tensor - table_bytes)), 0.0,
                            {"tensor_bytes": extra_tensor, "layout_bytes": extra_layout,
                             "file_bytes": sizes[b][2] - sizes[a][2]}))
    expected = {(v, t): embed.param_count(v, lab.width, tied=t) for v, t in sizes}
    ok = all(sizes[key][0] == expected[key] for key in sizes)
    listing = ", ".join(f"V={v} {'tied' if t else 'untied'} {sizes[v, t][0]} values/{sizes[v, t][1]} B tables/"
                        f"{sizes[v, t][2]} B files" for v, t in sorted(sizes, key=lambda key: (key[0], not key[1])))
    checks.insert(0, Check("sizes", "tied/untied", ok, f"values held == embed.param_count: {listing}", None, None,
                           {f"{v}_{'tied' if t else 'untied'}": {"values": sizes[v, t][0], "tensor_bytes": sizes[v, t][1],
                                                                 "file_bytes": sizes[v, t][2]} for v, t in sizes}))
    return checks
