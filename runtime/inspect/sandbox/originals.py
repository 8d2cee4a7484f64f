"""The original model's outputs on the proof's feeds, given ahead. Where inspect's child opens a session of the
original of its own to write the layout (work._written_apart: the model measured is let go first) and a --retie
will prove the model, that session also shows the heads' hidden vectors and runs the proof's feeds, and the outputs
are saved here: the proof then reads them instead of opening the original once more (a load of the whole model).
The proof takes them only where they were run on the very feeds it makes (bit for bit) and show just the values it
compares; otherwise it runs the original itself, as before. Values are shown only where that cannot change what
onnxruntime's optimizer makes of the graph (shown_ahead): the layout that session writes is the report's."""
import math
import zipfile

import numpy as np

FUSED_INTO_MATMUL = ("Transpose", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "DequantizeLinear",
                     "QuantizeLinear", "DynamicQuantizeLinear")  # a matmul's input made by one of these may be
# fused into it (TransposeMatMul, the QDQ fusions): shown as an output, the fusion would not be made


def shown_ahead(proto, heads):
    """The hidden vectors `heads` (the main graph's heads shaped as a table: HeadEntry) read, to be shown as
    outputs of the original `proto`, or None where showing one could change what onnxruntime's optimizer makes of
    the graph: a head whose product is not already a graph output (MatMul + Add -> Gemm and the like need it to
    be no output), a hidden vector that no node makes, or one made by an op fused into the matmul reading it
    (FUSED_INTO_MATMUL, or a Mul / Div with a constant, which MatMulScaleFusion folds into it)."""
    outputs = {o.name for o in proto.graph.output}
    constants = {t.name for t in proto.graph.initializer if math.prod(t.dims) == 1} | {
        out for node in proto.graph.node if node.op_type == "Constant" for out in node.output}
    names = set()
    for head in heads:
        node = head.node
        made = head.producer.get(node.input[0])  # its scope's map, the main graph's
        if node.output[0] not in outputs or made is None or made.op_type in FUSED_INTO_MATMUL or (
                made.op_type in ("Mul", "Div") and constants.intersection(made.input)):
            return None
        names.add(node.input[0])
    return sorted(names) or None


def save(outputs, feed_sets, path, shown):
    """{"path", "index", "shown"} for the outputs of the original (`outputs`: one dict per feed set of `feed_sets`,
    [(what, feeds)]; `shown` the values shown besides its graph outputs) saved with their feeds at `path` (.npz,
    arrays in order; "index": [[what, output names, feed names]]), or None where one is not a plain array (np.load
    would need pickle)."""
    arrays, index = [], []
    for (said, feeds), run in zip(feed_sets, outputs):
        index.append([said, list(run), list(feeds)])
        arrays += [np.asarray(v) for v in run.values()] + [np.asarray(v) for v in feeds.values()]
    if any(a.dtype.hasobject for a in arrays):
        return None
    with open(path, "wb") as f:
        np.savez(f, *arrays)
    return {"path": path, "index": index, "shown": sorted(shown)}


def given(originals, feed_sets, watched):
    """The original's outputs saved ahead (save's `originals`), one dict per feed set, where they were run on
    exactly `feed_sets` (the same steps, the same feeds bit for bit) showing exactly the values of `watched`; else
    None, also where the file cannot be read as it was written, or where inspect's child saw the original refused
    (ahead.run_ahead)."""
    if not originals or "refused" in originals or originals["shown"] != sorted(set(watched)) or \
            [entry[0] for entry in originals["index"]] != [said for said, _ in feed_sets]:
        return None
    try:
        return _read(originals, feed_sets)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None


def _read(originals, feed_sets):
    """given()'s outputs from the file, or None where a feed differs or it holds other arrays than the index says."""
    olds = []
    with np.load(originals["path"], allow_pickle=False) as data:
        if len(data.files) != sum(len(outputs) + len(fed) for _, outputs, fed in originals["index"]):
            return None
        arrays = iter([data[f"arr_{i}"] for i in range(len(data.files))])
        for (_, outputs, fed), (_, feeds) in zip(originals["index"], feed_sets):
            run = {name: next(arrays) for name in outputs}
            saved = {name: next(arrays) for name in fed}
            if saved.keys() != feeds.keys() or not all(_same(saved[n], feeds[n]) for n in feeds):
                return None
            olds.append(run)
    return olds


def _same(a, b):
    """Whether two arrays are the same, bit for bit (dtype and shape too)."""
    b = np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
