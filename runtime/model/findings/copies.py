"""The copies onnxruntime's optimizer makes of tables and heads: the initializers its optimized model adds, each
with the table or head whose values it holds (the same, transposed, reshaped or widened), and the element counts
such a copy would have (which decide whether an optimized model's data must be written to be compared)."""
import numpy as np
from onnx import TensorProto

from runtime.model.findings.relations import BYTES_AT_ONCE, same_bytes, same_values
from runtime.resident import unscoped

WIDENED = "FusedBack_"  # onnxruntime's FuseInitializersTransformer: the float32 copy of a half-precision weight
# the CPU provider's inserted Cast read, named "FusedBack_" + the weight's name (a suffix added if that is taken)


def widened_others(model, copies, stored):
    """The bytes the CPU provider's float32 widenings of the weights other than `stored` (a table's own tensors)
    add beyond those weights as stored: each widening (a runtime copy named WIDENED + the weight's name, holding no
    table's values) replaces its half-precision weight in the session, so the other weights are held at twice
    their stored bytes where they are widened."""
    added = 0
    for c in copies or []:
        name = c["name"][len(WIDENED):] if c["name"].startswith(WIDENED) else None
        if name is None or c.get("copy_of") or name in stored or name not in model.tensors:
            continue
        added += c["bytes"] - model.tensors[name].nbytes
    return added


def runtime_copies(model, optimized, watched, folded=None):
    """Initializers the optimized model holds that `model` does not, in its main graph and in every subgraph (an
    If branch's folded Transpose; `graph` names it there), each with the watched initializer whose values it holds,
    if any: the same, transposed, or reshaped (the same bytes under other dims). `folded` ({name: {"of", "view"}}:
    sandbox.folding.folded_from's, for an optimized model read for its layout alone) tells a main-graph copy by
    the node it was folded from, its values not read."""
    copies, folded = [], folded or {}
    scopes = [("main", optimized.tensors, model.tensors)] + [
        (path, tensors, model.bodies.get(path, {})) for path, tensors in sorted(optimized.bodies.items())]
    for path, tensors, before in scopes:
        for name, tensor in tensors.items():
            if name in before:
                continue
            entry = {"name": name, "bytes": tensor.nbytes, "shape": tensor.dims}
            if path != "main":
                entry["graph"] = path
            told = folded.get(name) if path == "main" else None
            if told is not None:  # its node says which weight it holds, and how: no value read
                view = _told_view(model.tensors.get(told["of"]), tensor, told["view"])
                if view and told["of"] in watched:
                    entry.update(copy_of=told["of"], view=view, transposed=view.endswith("transposed"))
                copies.append(entry)
                continue
            for source_name in watched:
                view = _copy_view(model.tensors[source_name], tensor)
                if view:
                    entry.update(copy_of=source_name, view=view, transposed=view.endswith("transposed"))
                    break
            copies.append(entry)
    return copies


def _copy_view(source, tensor):
    """How `tensor` holds `source`'s values ("transposed", "same", "reshaped", "widened", "widened_transposed"),
    or None."""
    if same_values(source, tensor, transposed=True) and source.dims != tensor.dims:
        return "transposed"
    if source.data_type == tensor.data_type and same_bytes(source, tensor):
        return "same" if source.dims == tensor.dims else "reshaped"
    if _widened(source, tensor, transposed=False):
        return "widened"
    if _widened(source, tensor, transposed=True):
        return "widened_transposed"
    return None


def _told_view(source, tensor, view):
    """`view` where `tensor`'s dims and type agree with holding `source` that way (folding.folded_from said so from
    the node that made it), else None."""
    if source is None:
        return None
    dims = {"transposed": source.dims[::-1], "same": source.dims}.get(view)
    kind = TensorProto.FLOAT if view == "widened" else source.data_type
    agree = tensor.dims == dims if dims else tensor.elements == source.elements and (
        view == "reshaped" or (view == "widened" and tensor.dims == source.dims))
    return view if agree and tensor.data_type == kind else None


def copy_sizes(model, names):
    """The element counts of the initializers `names` (of tables, heads): an optimize job's "sizes", the sizes
    of the copies onnxruntime's optimizer could make of them; None (write the data anyway) where one is not found."""
    sizes = set()
    for scoped_name in names:
        name, graph = unscoped(scoped_name)
        tensor = (model.bodies.get(graph, {}) if graph else model.tensors).get(name)
        if tensor is None:
            return None
        sizes.add(tensor.elements)
    return sorted(sizes)


def _widened(a, b, transposed):
    """Whether `b` holds float16 / bfloat16 `a`'s values as float32 (the copy onnxruntime's CPU provider makes
    when it runs a half-precision head through a float32 kernel: an inserted Cast, constant-folded), compared a
    chunk of rows at a time."""
    if a.data_type not in (TensorProto.FLOAT16, TensorProto.BFLOAT16) or b.data_type != TensorProto.FLOAT \
            or len(a.dims) != 2 or a.dims != (b.dims[::-1] if transposed else b.dims):
        return False
    x, y = a.values(), b.values()
    y = y.T if transposed else y
    if not _rows_widened(x, y, 0, 1):  # another weight of the same shape: told apart by its first row
        return False
    rows = max(1, BYTES_AT_ONCE // max(1, 4 * x.shape[1]))
    return all(_rows_widened(x, y, i, i + rows) for i in range(0, x.shape[0], rows))


def _rows_widened(x, y, start, stop):
    """Whether rows start:stop of float32 `y` are those of half-precision `x` widened, bit for bit."""
    return np.array_equal(x[start:stop].astype(np.float32).view(np.uint32),
                          np.ascontiguousarray(y[start:stop]).view(np.uint32))
