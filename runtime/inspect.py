"""python -m runtime.inspect MODEL.onnx [--json] [--retie OUT.onnx]: find tied, duplicated and runtime-copied tables.

Tables are initializers a Gather reads rows from; heads are the weights of a MatMul or Gemm, seen
through Identity and Transpose. Each table/head pair of matching shape is `shared` (one
initializer), `duplicate` (same values), `transposed_duplicate` (same values, transposed) or
`distinct`. Runtime copies are the initializers onnxruntime's optimized model adds. --retie makes
every duplicated head read its table, in a form onnxruntime keeps as one (Gemm with transB=1),
proves the outputs unchanged, and only then writes OUT.
"""
import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

import graphs
from runtime.runner import Runner, optimized_model

U = 2.0**-24


class InspectError(Exception):
    """Bad input: one line, exit 2."""


# --- reading a model, untrusted ----------------------------------------------------------------------

def _inside(folder, location):
    """The absolute path of `location` if it stays inside `folder`, else an InspectError."""
    if os.path.isabs(location) or not location:
        raise InspectError(f"external data path {location!r} is not relative to the model's folder; refused")
    path = os.path.realpath(os.path.join(folder, location))
    if os.path.commonpath([path, folder]) != folder:
        raise InspectError(f"external data path {location!r} escapes the model's folder; refused")
    return path


def load(path):
    """(model with every tensor's data in memory, bytes on disk including external data files)."""
    if not os.path.isfile(path):
        raise InspectError(f"{path}: no such file")
    with open(path, "rb") as f:
        data = f.read()
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except DecodeError:
        raise InspectError(f"{path}: not an ONNX model (it does not parse; truncated?)") from None
    if model.ir_version <= 0 or not model.opset_import or not model.HasField("graph"):
        raise InspectError(f"{path}: not an ONNX model (no IR version, opset or graph)")
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    files = {}
    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        source = _inside(folder, info.get("location", ""))
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
            with open(source, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                length = size - offset if length < 0 else length
                if offset < 0 or offset + length > size:
                    raise InspectError(f"{tensor.name}: external data {info['location']} has {size} bytes, "
                                       f"the tensor needs [{offset}, {offset + length})")
                f.seek(offset)
                tensor.raw_data = f.read(length)
        except (OSError, ValueError) as e:
            raise InspectError(f"{tensor.name}: cannot read external data {info.get('location')!r}: {e}") from None
        files[source] = size
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]
    return model, len(data) + sum(files.values())


def _array(tensor):
    try:
        return numpy_helper.to_array(tensor)
    except Exception as e:  # a malformed tensor in an untrusted file
        raise InspectError(f"initializer {tensor.name!r} cannot be read: {e}") from None


# --- what is tied to what ----------------------------------------------------------------------------

def _resolve(name, producer, weights):
    """Follow Identity and 2-D Transpose nodes back from `name`: (initializer, transposes passed) or None."""
    flips = 0
    while name not in weights:
        node = producer.get(name)
        if node is None or node.op_type not in ("Identity", "Transpose"):
            return None
        if node.op_type == "Transpose":
            perm = [a.ints for a in node.attribute if a.name == "perm"]
            if perm and list(perm[0]) != [1, 0]:
                return None
            flips += 1
        name = node.input[0]
    return name, flips


def find_tables_and_heads(model):
    """Tables: [(initializer, Gather node)]; heads: [{initializer, node, as_table, flips}]."""
    graph = model.graph
    weights = {t.name for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    tables, heads = [], []
    for node in graph.node:
        if node.op_type == "Gather" and node.input:
            found = _resolve(node.input[0], producer, weights)
            if found and found[1] == 0 and found[0] not in [t for t, _ in tables]:
                tables.append((found[0], node))
        elif node.op_type in ("MatMul", "Gemm") and len(node.input) >= 2:
            found = _resolve(node.input[1], producer, weights)
            if found:
                trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0) if node.op_type == "Gemm" else 0
                # stored as [vocab, width], like a table, when the transposes on the way and transB add up odd
                heads.append({"initializer": found[0], "node": node, "flips": found[1],
                              "as_table": (found[1] + trans_b) % 2 == 1})
    return tables, heads


def relate(model, tables, heads):
    """[{table, head, relation, wasted_bytes, node, via_transpose}] for every table/head pair of matching shape."""
    arrays = {}

    def array(name):
        if name not in arrays:
            arrays[name] = _array(next(t for t in model.graph.initializer if t.name == name))
        return arrays[name]

    pairs = []
    for table, _ in tables:
        t = array(table)
        for head in heads:
            h = array(head["initializer"])
            if t.ndim != 2 or h.shape != (t.shape if head["as_table"] else t.shape[::-1]):
                continue
            if head["initializer"] == table:
                relation, wasted = "shared", 0
            elif h.dtype == t.dtype and np.array_equal(h if head["as_table"] else h.T, t):
                relation, wasted = ("duplicate" if head["as_table"] else "transposed_duplicate"), h.nbytes
            else:
                relation, wasted = "distinct", 0
            pairs.append({"table": table, "head": head["initializer"], "relation": relation, "wasted_bytes": wasted,
                          "node": head["node"].name or head["node"].output[0], "via_transpose": head["flips"] > 0})
    return pairs, arrays


def _nbytes(tensor):
    return math.prod(tensor.dims) * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


def runtime_copies(source, model, arrays, folder):
    """Initializers onnxruntime's optimized model holds that the model does not, and what each copies."""
    optimized = optimized_model(source, folder)
    names = {t.name for t in model.graph.initializer}
    copies = []
    for tensor in optimized.graph.initializer:
        if tensor.name in names:
            continue
        entry = {"name": tensor.name, "bytes": _nbytes(tensor), "shape": list(tensor.dims)}
        for table, values in arrays.items():
            if values.ndim == 2 and list(tensor.dims) in (list(values.shape), list(values.shape[::-1])):
                copy = _optimized_value(tensor, folder)
                if copy is not None and np.array_equal(copy.T if list(copy.shape) != list(values.shape) else copy,
                                                       values):
                    entry["copy_of"] = table
                    entry["transposed"] = list(copy.shape) != list(values.shape)
        copies.append(entry)
    return copies, sum(_nbytes(t) for t in optimized.graph.initializer)


def _optimized_value(tensor, folder):
    """The values of an initializer in the optimized model we wrote into `folder` ourselves."""
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)
    try:
        onnx.external_data_helper.load_external_data_for_tensor(copy, folder)
        return numpy_helper.to_array(copy)
    except (OSError, ValueError):
        return None


def inspect_model(path, folder):
    """Everything the report shows, as one dict (the --json output plus what --retie needs)."""
    model, file_bytes = load(path)
    initializers = []
    for tensor in model.graph.initializer:
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        initializers.append({"name": tensor.name, "dtype": np.dtype(dtype).name, "shape": list(tensor.dims),
                             "elements": math.prod(tensor.dims), "bytes": _nbytes(tensor)})
    tables, heads = find_tables_and_heads(model)
    pairs, arrays = relate(model, tables, heads)
    try:
        copies, memory = runtime_copies(os.path.abspath(path), model, arrays, folder)
    except Exception as e:  # onnxruntime refusing the model is a finding about the input, not a crash
        raise InspectError(f"{path}: onnxruntime cannot load it: {str(e).splitlines()[0]}") from None
    return {"model": model, "tables": tables, "heads": heads, "file_bytes": file_bytes, "initializers": initializers,
            "pairs": pairs, "runtime_copies": copies, "optimized_bytes": memory}


# --- retie ---------------------------------------------------------------------------------------------

def _const(graph, name, values):
    graph.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
    return name


def retie(model, heads, pairs):
    """Rewrite `model` in place so that every duplicated head, and every head reading its table through a
    Transpose (which onnxruntime would fold into a copy), becomes Gemm(transB=1) on the table itself.
    Returns [(node output, hidden input, table)] for the heads rewritten."""
    graph = model.graph
    table_of = {}
    for p in pairs:
        if p["relation"] in ("duplicate", "transposed_duplicate") or (p["relation"] == "shared" and p["via_transpose"]):
            table_of[p["head"]] = p["table"]
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    rewritten = []
    for i, head in enumerate(h for h in heads if h["initializer"] in table_of):
        node, table = head["node"], table_of[head["initializer"]]
        vocab, width = shapes[table]
        hidden, output = node.input[0], node.output[0]
        if node.op_type == "Gemm":
            kept = [a for a in node.attribute if a.name != "transB"]  # alpha, beta, transA stay
            del node.attribute[:]
            node.attribute.extend(kept)
            node.input[1] = table  # B becomes the table itself, read transposed in place
            node.attribute.append(helper.make_attribute("transB", 1))
        else:
            taken = {n for node_ in graph.node for n in list(node_.input) + list(node_.output)}
            prefix = next(p for p in (f"retie{i}_{j}_" for j in range(10**6)) if not any(n.startswith(p) for n in taken))
            at = list(graph.node).index(node)
            new = [
                helper.make_node("Shape", [hidden], [prefix + "hidden_shape"], name=prefix + "shape"),
                helper.make_node("Slice", [prefix + "hidden_shape", _const(graph, prefix + "zero", [0]),
                                           _const(graph, prefix + "minus_one", [-1])], [prefix + "lead_dims"],
                                 name=prefix + "lead_dims"),
                helper.make_node("Concat", [prefix + "lead_dims", _const(graph, prefix + "vocab", [vocab])],
                                 [prefix + "logits_shape"], name=prefix + "logits_shape", axis=0),
                helper.make_node("Reshape", [hidden, _const(graph, prefix + "rows_shape", [-1, width])], [prefix + "rows"],
                                 name=prefix + "flatten"),
                helper.make_node("Gemm", [prefix + "rows", table], [prefix + "logits_rows"], name=prefix + "tied_head",
                                 doc_string=f"tied head: hidden @ {table}^T, read in place (retied by runtime.inspect)",
                                 transB=1),
                helper.make_node("Reshape", [prefix + "logits_rows", prefix + "logits_shape"], [output],
                                 name=prefix + "unflatten"),
            ]
            graph.node.remove(node)
            for offset, n in enumerate(new):
                graph.node.insert(at + offset, n)
        rewritten.append((output, hidden, table))
    _drop_dead(graph)
    return rewritten


def _drop_dead(graph):
    """Remove nodes whose outputs nobody reads, then initializers nobody reads."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {name for node in graph.node for name in node.input} | outputs
        dead = [n for n in graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    read = {name for node in graph.node for name in node.input} | outputs
    for tensor in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(tensor)


def _feeds(model, tables, rng):
    """Random inputs: ids within each table's rows, other integers 1, floats standard normal; free dims 3."""
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    rows = {gather.input[1]: weights[table][0] for table, gather in tables}
    feeds = {}
    for value in model.graph.input:
        if value.name in weights:
            continue
        tensor_type = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 3 for d in tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if value.name in rows:
            feeds[value.name] = rng.integers(0, rows[value.name], size=shape).astype(dtype)
        elif np.dtype(dtype).kind in "iub":
            feeds[value.name] = np.ones(shape, dtype=dtype)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _with_outputs(model, names):
    """A copy of `model` that also outputs `names` (the hidden vectors the heads read)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {o.name for o in copy.graph.output}
    known = {v.name: v for v in list(onnx.shape_inference.infer_shapes(copy).graph.value_info) + list(copy.graph.input)}
    for name in names:
        if name not in present:
            if name not in known:
                raise ValueError(f"shape inference does not type {name!r}, the input of a head")
            copy.graph.output.append(known[name])
    return copy


def prove(before, after, rewritten, tables, arrays, folder):
    """Both models on random ids: head outputs within 2 gamma_w sum|a b|, everything else bit for bit.
    Returns a list of one-line failures (empty: proven)."""
    hidden_names = sorted({hidden for _, hidden, _ in rewritten})
    paths = []
    for label, model in (("before", before), ("after", after)):
        path = os.path.join(folder, f"{label}.onnx")
        graphs.save(_with_outputs(model, hidden_names), path, overwrite=True)
        paths.append(path)
    feeds = _feeds(before, tables, np.random.default_rng(0))
    sessions = [Runner(p).session for p in paths]
    names = [o.name for o in sessions[0].get_outputs()]
    old, new = (dict(zip(names, s.run(names, feeds))) for s in sessions)
    head_of = {output: (hidden, table) for output, hidden, table in rewritten}
    failures = []
    for name in names:
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            failures.append(f"output {name!r}: {a.shape} {a.dtype} became {b.shape} {b.dtype}")
        elif name in head_of:
            hidden, table = head_of[name]
            h = np.abs(old[hidden].astype(np.float64))
            width = arrays[table].shape[1]
            bound = 2 * width * U / (1 - width * U) * (h @ np.abs(arrays[table].astype(np.float64)).T)
            if np.isnan(b).any() or not np.all(np.abs(a.astype(np.float64) - b) <= bound):
                failures.append(f"output {name!r}: differs beyond 2 gamma_w sum|a b|")
        elif not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            failures.append(f"output {name!r}: not bit-identical, and not a head output whose bound is known")
    return failures


# --- the command ---------------------------------------------------------------------------------------

def _report(info, path, out):
    w = out.write
    w(f"{path}: {len(info['initializers'])} initializers, {info['file_bytes']} bytes on disk\n")
    w(f"  {'name':<32} {'dtype':<8} {'shape':<16} {'elements':>12} {'bytes':>12}\n")
    for i in info["initializers"]:
        w(f"  {i['name']:<32} {i['dtype']:<8} {str(i['shape']):<16} {i['elements']:>12} {i['bytes']:>12}\n")
    w("tables (read by Gather): " + (", ".join(t for t, _ in info["tables"]) or "none") + "\n")
    heads = [f"{h['initializer']} ({h['node'].op_type}{', through Transpose' if h['flips'] else ''})"
             for h in info["heads"]]
    w("heads (MatMul/Gemm weights): " + (", ".join(heads) or "none") + "\n")
    for p in info["pairs"]:
        w(f"pair {p['table']} / {p['head']}: {p['relation']}, {p['wasted_bytes']} bytes wasted in the file\n")
    if not info["pairs"]:
        w("no table/head pair of matching shape\n")
    for c in info["runtime_copies"]:
        what = f" = {c['copy_of']}{' transposed' if c['transposed'] else ''}" if "copy_of" in c else ""
        w(f"runtime copy {c['name']} {c['shape']}: {c['bytes']} bytes added by onnxruntime's optimizations{what}\n")
    if not info["runtime_copies"]:
        w("runtime copies: none (onnxruntime's optimized model adds no initializer)\n")


def _json(info):
    return {"file_bytes": info["file_bytes"], "initializers": info["initializers"],
            "pairs": [{k: p[k] for k in ("table", "head", "relation", "wasted_bytes")} for p in info["pairs"]],
            "runtime_copies": info["runtime_copies"]}


def _retie(info, path, out_path, folder, say):
    model = info["model"]
    before = onnx.ModelProto()
    before.CopyFrom(model)
    if any(op.domain in ("", "ai.onnx") and op.version < 13 for op in model.opset_import):
        raise InspectError(f"{path}: opset below 13; --retie rewrites with opset-13 Slice and Reshape")
    rewritten = retie(model, info["heads"], info["pairs"])
    if not rewritten:
        say("retie: nothing to do: no duplicated head, and no head reading its table through a Transpose\n")
        return 0
    _, arrays = relate(before, info["tables"], info["heads"])
    try:
        failures = prove(before, model, rewritten, info["tables"], arrays, folder)
        staged = os.path.join(folder, "retied.onnx")
        graphs.save(model, staged)
        copies, memory = runtime_copies(staged, model, arrays, folder)
    except Exception as e:  # onnx or onnxruntime refusing the rewritten model: report it, write nothing
        say(f"retie: failed, nothing written: {str(e).splitlines()[0] if str(e) else type(e).__name__}\n")
        return 1
    tables = {table for _, _, table in rewritten}
    for table in sorted(tables):
        extra = [c["name"] for c in copies if c.get("copy_of") == table]
        if extra:
            failures.append(f"onnxruntime still copies {table} at run time: {extra}")
    if failures:
        say(f"retie: not proven, nothing written: {failures[0]}\n")
        return 1
    written = graphs.save(model, out_path)
    size = sum(os.path.getsize(p) for p in written)
    say(f"retie: {len(rewritten)} head(s) now read {sorted(tables)}; outputs equal on random ids (heads within "
        f"2 gamma_w sum|a b|, the rest bit for bit); onnxruntime keeps one copy\n")
    say(f"retie: wrote {out_path}: {info['file_bytes']} -> {size} bytes on disk "
        f"(saved {info['file_bytes'] - size}); initializers in onnxruntime's optimized model "
        f"{info['optimized_bytes']} -> {memory} bytes (saved {info['optimized_bytes'] - memory})\n")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise InspectError(message)


def main(argv=None):
    parser = _Parser(prog="python -m runtime.inspect", description=__doc__.split("\n\n")[1])
    parser.add_argument("model", metavar="MODEL.onnx")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--retie", metavar="OUT.onnx", help="write a copy whose duplicated heads share their table")
    try:
        args = parser.parse_args(argv)
        if args.retie:
            if os.path.realpath(args.retie) == os.path.realpath(args.model):
                raise InspectError("OUT is MODEL: --retie never touches its input; name another file")
            for target in (args.retie, graphs.storage.data_path(args.retie)):
                if os.path.lexists(target):
                    raise InspectError(f"{target} exists; refusing to overwrite it")
            if not os.path.isdir(os.path.dirname(os.path.abspath(args.retie))):
                raise InspectError(f"{os.path.dirname(args.retie)}: no such folder for OUT")
        with tempfile.TemporaryDirectory(prefix="onnx-lab-inspect-") as folder:
            info = inspect_model(args.model, folder)
            say = sys.stderr.write if args.json else sys.stdout.write
            if args.json:
                sys.stdout.write(json.dumps(_json(info), indent=2) + "\n")
            else:
                _report(info, args.model, sys.stdout)
            return _retie(info, args.model, args.retie, folder, say) if args.retie else 0
    except InspectError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
