"""The graph edits --retie makes: names no graph of the model uses yet, small constants, shells for tensors written
from arrays, graphs.tie's run-time view inserted before a node, dead nodes and initializers removed (a node with
a body reads what the body reads), and the external data the rewritten model is written from."""
import itertools

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from graphs.storage import EXTERNAL_FROM, PROTOBUF_LIMIT
from graphs.tie import unfolded_view
from runtime.model.findings.counting import human
from runtime.model.read import paths
from runtime.model.read.model import all_tensors, check_tensor, graph_paths
from runtime.model.read.text import InspectError

INLINE_MOST = PROTOBUF_LIMIT // 2  # nested tensors read into the model file leave room for its graph


def shell(graph, name, array):
    """Declare initializer `name` with `array`'s type and dims; its data is written from `array` when saved."""
    tensor = graph.initializer.add()
    tensor.name, tensor.data_type = name, helper.np_dtype_to_tensor_dtype(array.dtype)
    tensor.dims.extend(array.shape)
    tensor.data_location = TensorProto.EXTERNAL
    return array


def external_sources(model):
    """{name: its bytes on disk} of each external initializer of the main graph, for graphs.storage to write into
    OUT's data file; every other external tensor is read into the model first (inline_nested), and so is the raw
    data its shell left in an inline model's file, where it is small (inline_stored)."""
    inline_nested(model)
    inline_stored(model)
    return {t.name: model.tensors[t.name].raw() for t in model.proto.graph.initializer
            if t.data_location == TensorProto.EXTERNAL}


def inline_nested(model):
    """Read into `model.proto` each external tensor outside its main graph's initializers (a Constant's value, a
    subgraph's initializer: Optimum's large exports hold them in model.onnx_data), checked as load() checks it.
    graphs.storage moves only the main graph's, so these would keep naming the original's data file (issue 47).
    InspectError, nothing changed, where they are too large to hold in a model file."""
    nested = [t for t, top in all_tensors(model.proto.graph, model.proto.functions)
              if not top and t.data_location == TensorProto.EXTERNAL]
    files, root = {}, paths.root_of(model.folder)
    checked = [check_tensor(t, model.folder, files, root) for t in nested]
    size = sum(c.nbytes for c in checked)
    if size > INLINE_MOST:
        raise InspectError(f"{model.path}: {human(size)} of Constant values and subgraph initializers lie in external "
                           f"data; --retie writes them into the model file, which holds {human(INLINE_MOST)} of "
                           "them at most; nothing written")
    for tensor, data in zip(nested, checked):
        tensor.raw_data = bytes(data.raw())
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT


def inline_stored(model, most=EXTERNAL_FROM):
    """Read into `model.proto` the raw data of the main graph's initializers that an inline model's shell left in its
    file (Tensor.stored), where they hold `most` bytes or less together: OUT is then as inline as the original
    (graphs.storage writes a model whose tensors are all inline as one file). Larger ones stay where they lie and
    are written from there into OUT's data file, never held whole here."""
    stored = [t for t in model.proto.graph.initializer if t.data_location == TensorProto.EXTERNAL
              and t.name in model.tensors and model.tensors[t.name].stored is not None]
    if sum(model.tensors[t.name].nbytes for t in stored) > most:
        return
    for tensor in stored:
        tensor.raw_data = bytes(model.tensors[tensor.name].raw())
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT


def const(graph, name, values):
    """Add an int64 initializer `name` holding `values` to `graph`; its name."""
    graph.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
    return name


def unique_name(model, base):
    """`base`, or `base` with the first number that makes it a name no tensor or node of the model starts with, in
    any of its graphs (so it may prefix the names of the nodes and tensors it brings, wherever they go)."""
    taken = set(model.tensors)
    for _, _, g in graph_paths(model.proto.graph):
        taken.update(t.name for t in g.initializer)
        taken.update(n for node in g.node for n in list(node.input) + list(node.output) + [node.name])
    return next(name for name in itertools.chain([base], (f"{base}{j}" for j in itertools.count()))
                if not any(t.startswith(name) for t in taken))


def view_of(graph, model, node, table, anchor, dims):
    """graphs.tie's run-time view of initializer `table`, anchored on `anchor`, inserted before `node`: its name."""
    prefix = unique_name(model, "retie_view") + "_"
    view, constants, _ = unfolded_view(table, anchor, dims, prefix + "table", prefix)
    named = {name: f"{table}.{name}" for name in constants}  # each constant named after the table it serves
    for n in view:
        n.input[:] = [named.get(i, i) for i in n.input]
    for name, values in constants.items():  # in the main graph: a branch reads them from outside, like the table
        const(model.proto.graph, named[name], values)
    at = list(graph.node).index(node)
    for offset, n in enumerate(view):
        graph.node.insert(at + offset, n)
    return prefix + "table"


def drop_dead(graph):
    """Remove nodes whose outputs nobody reads (and what then feeds only them), then initializers nobody reads, in
    `graph` and then in each body of the nodes kept. A node with a body reads what the body reads (outer-scope
    values). Linear in nodes and edges: each node is dropped once, counting down its inputs' readers."""
    nodes = list(graph.node)
    inputs = [list(node.input) + sorted(_read_inside(node)) for node in nodes]
    readers = {}
    for names in inputs:
        for name in names:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    producer = {out: i for i, node in enumerate(nodes) for out in node.output}

    def unread(node):
        return not any(readers.get(o, 0) or o in outputs for o in node.output)

    dead, todo = set(), [i for i, node in enumerate(nodes) if unread(node)]
    while todo:
        i = todo.pop()
        if i in dead:
            continue
        dead.add(i)
        for name in inputs[i]:
            readers[name] -= 1
            j = producer.get(name)
            if j is not None and j not in dead and unread(nodes[j]):
                todo.append(j)
    for i in sorted(dead, reverse=True):  # by index: no message is compared or copied
        del graph.node[i]
    read = {name for i, names in enumerate(inputs) if i not in dead for name in names} | outputs
    for i in sorted((i for i, t in enumerate(graph.initializer) if t.name not in read), reverse=True):
        del graph.initializer[i]
    for node in graph.node:
        for body in _bodies_of(node):
            drop_dead(body)


def _bodies_of(node):
    """The subgraphs a node holds (If branches, Loop and Scan bodies)."""
    return [b for a in node.attribute for b in ([a.g] if a.HasField("g") else list(a.graphs))]


def _read_inside(node):
    """Every name the nodes in `node`'s bodies read, at any depth (the outer-scope values among them)."""
    names, stack = set(), _bodies_of(node)
    while stack:
        body = stack.pop()
        for inner in body.node:
            names.update(inner.input)
            stack += _bodies_of(inner)
    return names
