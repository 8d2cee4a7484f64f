"""Sizes: values held against embed.param_count, and bytes on disk split into tensor data and layout."""
import math
import os

import onnx
from onnx import TensorProto

import graphs
from graphs.storage import data_path
from runtime.compare.bounds import Check


def vocab_width_tensors(model, vocab, width):
    """Initializers holding a vocab x width table, either way round: the one rule for "a table" in compare."""
    return [t.name for t in model.graph.initializer if sorted(t.dims) == sorted([vocab, width])]


def saved_bytes(path, vocab, width):
    """(table data bytes, file bytes) of a saved model: the bytes of each vocab x width initializer as stored
    (inline raw data, or the length of its external range); everything else in the files is layout (names, docs,
    small constants, protobuf framing, alignment padding between external tensors)."""
    model = onnx.load(path, load_external_data=False)
    tables = set(vocab_width_tensors(model, vocab, width))
    tensors = 0
    for tensor in model.graph.initializer:
        if tensor.name not in tables:
            continue
        if tensor.data_location == TensorProto.EXTERNAL:
            tensors += int({e.key: e.value for e in tensor.external_data}["length"])
        else:
            tensors += len(tensor.raw_data)
    files = os.path.getsize(path) + (os.path.getsize(data_path(path)) if os.path.exists(data_path(path)) else 0)
    return tensors, files


def measure_sizes(vocab, width, seed, folder):
    """{(vocab, tied): (values in vocab x width tables, table bytes, file bytes)} for the tied and untied heads at
    `vocab` and the tied head at 2 vocab, built by graphs and saved as graphs.save writes them. It needs nothing
    from the reference, so it runs in the second process while the rest of compare works."""
    sizes = {}
    doubled = graphs.make_table(2 * vocab, width, seed)
    head = graphs.make_table(vocab, width, seed + 1)
    for rows in (vocab, 2 * vocab):
        table = doubled[:rows]  # a row never depends on the vocabulary size
        for tied in (True, False) if rows == vocab else (True,):  # an untied 2V model would add nothing
            model = graphs.tied_logits(table) if tied else graphs.untied_logits(table, head)
            tables = set(vocab_width_tensors(model, rows, width))
            counted = sum(math.prod(t.dims) for t in model.graph.initializer if t.name in tables)
            path = os.path.join(folder, f"sizes_{rows}_{'tied' if tied else 'untied'}.onnx")
            graphs.save(model, path, overwrite=True, check=False)  # the builders checked these models
            sizes[rows, tied] = (counted, *saved_bytes(path, rows, width))
            del model
    return sizes


def check_sizes(config, reference, sessions):
    """Untying adds one table, doubling the vocabulary adds its rows: values against embed.param_count, bytes on disk
    split into table data and layout."""
    vocab, width = config.vocab, config.width
    table_bytes = 4 * vocab * width
    sizes = sessions.sizes()
    checks = []
    for label, (a, b), claim in (("untied - tied", ((vocab, True), (vocab, False)), "a second table"),
                                 ("tied, vocab x2", ((vocab, True), (2 * vocab, True)), "the added rows")):
        extra_values = sizes[b][0] - sizes[a][0]
        extra_tensor, extra_layout = sizes[b][1] - sizes[a][1], (sizes[b][2] - sizes[b][1]) - (sizes[a][2] - sizes[a][1])
        ok = extra_values == vocab * width and extra_tensor == table_bytes
        checks.append(Check("sizes", "tied/untied", ok,
                            f"{label}: +{extra_values} values, table data +{extra_tensor} bytes = {claim} "
                            f"({table_bytes} bytes); layout (names, docs, shape constants, framing, alignment) "
                            f"{extra_layout:+d} bytes, on disk +{sizes[b][2] - sizes[a][2]} bytes",
                            float(abs(extra_tensor - table_bytes)), 0.0,
                            {"tensor_bytes": extra_tensor, "layout_bytes": extra_layout,
                             "file_bytes": sizes[b][2] - sizes[a][2]},
                            claim=f"{label}: +{extra_tensor} bytes of table data = {claim}"))
    expected = {(v, t): reference.embed.param_count(v, width, tied=t) for v, t in sizes}
    bad = sum(sizes[key][0] != expected[key] for key in sizes)
    listing = ", ".join(f"V={v} {'tied' if t else 'untied'} {sizes[v, t][0]} values/{sizes[v, t][1]} B tables/"
                        f"{sizes[v, t][2]} B files" for v, t in sorted(sizes, key=lambda key: (key[0], not key[1])))
    checks.insert(0, Check("sizes", "tied/untied", bad == 0,
                           f"values held == embed.param_count ({bad} of {len(sizes)} models differ): {listing}",
                           float(bad), 0.0,
                           {f"{v}_{'tied' if t else 'untied'}": {"values": sizes[v, t][0], "tensor_bytes": sizes[v, t][1],
                                                                 "file_bytes": sizes[v, t][2]} for v, t in sizes},
                           claim=f"values held == embed.param_count in {len(sizes)} models: V tied, V untied, 2V tied"))
    return checks
