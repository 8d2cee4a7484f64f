"""What is tied to what: table/head pairs, and the copies onnxruntime's optimized model adds."""
import numpy as np

_CHUNK = 16 * 2**20  # bytes compared at a time, so a memory-mapped table is never read whole at once


def same_values(a, b, transposed=False):
    """Whether 2-D tensors hold the same bytes (b read transposed when asked), a chunk of rows at a time."""
    if a.data_type != b.data_type or a.dims != (b.dims[::-1] if transposed else b.dims):
        return False
    if not transposed:
        x, y = a.raw(), b.raw()
        step = _CHUNK
        return all(np.array_equal(x[i:i + step], y[i:i + step]) for i in range(0, len(x), step))
    x, y = a.values(), b.values()
    if x is None:  # packed sub-byte codes: a transposed copy cannot be told without unpacking; say no
        return False
    rows = max(1, _CHUNK // max(1, x.itemsize * x.shape[1]))
    return all(np.array_equal(x[i:i + rows].view(np.uint8), np.ascontiguousarray(y[:, i:i + rows].T).view(np.uint8))
               for i in range(0, x.shape[0], rows))


def relate(model, tables, heads):
    """[{table, head, relation, wasted_bytes, node, via_transpose}] for every table/head pair of matching shape."""
    pairs = []
    for table, _ in tables:
        t = model.tensors[table]
        for head in heads:
            h = model.tensors[head["initializer"]]
            if h.dims != (t.dims if head["as_table"] else t.dims[::-1]):
                continue
            if head["initializer"] == table:
                relation, wasted = "shared", 0
            elif same_values(t, h, transposed=not head["as_table"]):
                relation, wasted = ("duplicate" if head["as_table"] else "transposed_duplicate"), h.nbytes
            else:
                relation, wasted = "distinct", 0
            pairs.append({"table": table, "head": head["initializer"], "relation": relation, "wasted_bytes": wasted,
                          "node": head["node"].name or head["node"].output[0], "via_transpose": head["flips"] > 0})
    return pairs


def runtime_copies(model, optimized, tables):
    """Initializers the optimized model holds that `model` does not, each with the table it copies, if any."""
    copies = []
    for name, tensor in optimized.tensors.items():
        if name in model.tensors:
            continue
        entry = {"name": name, "bytes": tensor.nbytes, "shape": tensor.dims}
        for table in tables:
            source = model.tensors[table]
            for transposed in (False, True):
                if same_values(source, tensor, transposed):
                    entry["copy_of"], entry["transposed"] = table, transposed
        copies.append(entry)
    return copies
