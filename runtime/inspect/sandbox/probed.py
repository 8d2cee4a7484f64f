"""The prepacked copies of a table's copies, where the layout was written with prepacking off (issue 57's decision).

A layout written in a session of its own (work._written_apart: the model's tensors inline, float16 weights, a fold
a kernel packs) is written with prepacking off, the same optimized graph either way: packing every weight of the
model again costs the most of that session (the Qwen2.5-shaped Optimum export: 5.2-6.6 s and 2.96 GiB with it,
2.2 s and 1.13 GiB without), and onnxruntime's CPU provider widens each float16 weight to a float32 copy that its
kernel would pack once more (SmolLM2's genai fp16 file: 1.30 GiB, 0.79 without). No prepacked copy is then recorded
beside the initializers. The ones that count, a kernel's packing of a table or of a copy of it, are made again here,
each alone: the same node (its op, attributes and name) with each of its constant inputs a tensor of the same type
and dims, in a session of the lab's settings with prepacking on, whose optimized model records what the kernel
packed (resident.prepacked_copies). The values are zeros: how much a kernel packs depends on the dims and the
node's attributes, not on the values. A model whose packing could not be probed this way keeps prepacking on.
"""
import math
import os
import tempfile

import onnx
from onnx import TensorProto, helper

from runtime.model.graph.ops import INTEGER_MATMULS, PACKING
from runtime.inspect.sandbox import answers

WHY = ("written with prepacking off, in a session of its own (every weight packed again, and a float16 weight's "
       "float32 widening packed beside it, cost that session most of its time and memory); each table copy's "
       "packing is probed apart (probed)")


def packing_off(proto):
    """Whether the layout of `proto` (a model's shell) may be written with prepacking off: no subgraph (a merged
    decoder's branches: retie.branches reads what every kernel packs) and no integer matmul (its activations' type
    is not its weight's: it is not probed)."""
    graphs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    return not any(n.op_type in INTEGER_MATMULS or any(a.type in graphs for a in n.attribute)
                   for n in proto.graph.node)


def unrecorded(layout, sizes):
    """answers.Unrecorded(WHY, probed: [{initializer, kernel, node, bytes}]): the prepacked copies a session with
    prepacking on would record of the initializers of `layout` (an optimized model, ModelProto without data) that hold
    one of `sizes` elements (the tables and their copies), for each packing kernel (ops.PACKING) that reads one."""
    from runtime.resident import prepacked_copies
    constants, counts = {t.name: t for t in layout.graph.initializer}, set(sizes or ())
    watched = {name for name, t in constants.items() if math.prod(t.dims) in counts}
    probed = []
    for node in layout.graph.node:
        typed = PACKING.get(node.op_type)
        if typed is None or not watched & set(node.input) or len(node.input) <= typed:
            continue
        activations = constants[node.input[typed]].data_type if node.input[typed] in constants else TensorProto.FLOAT
        found = prepacked_copies(_probed(layout, node, constants, activations))
        probed += [dict(p, node=node.name or node.output[0]) for p in found if p["initializer"] in watched]
    return answers.Unrecorded(WHY, probed)


def _alone(layout, node, constants, activations, folder):
    """A model of `node` alone, written in `folder`: each input that `layout` holds as an initializer one of its
    type and dims, of zeros (those past a page as external data in a sparse file: no page written or copied);
    the others the graph's inputs, of type `activations`; `layout`'s opsets. Its path."""
    zeros, inputs, end = [], [], 0
    for name in dict.fromkeys(i for i in node.input if i):
        if name not in constants:
            inputs.append(helper.make_tensor_value_info(name, activations, None))
            continue
        t, nbytes = constants[name], _nbytes(constants[name])
        tensor = TensorProto(name=name, data_type=t.data_type, dims=list(t.dims))
        if nbytes <= _PAGE:
            tensor.raw_data = bytes(nbytes)
        else:
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", _ZEROS), ("offset", str(end)), ("length", str(nbytes))):
                tensor.external_data.add(key=key, value=value)
            end += -(-nbytes // _PAGE) * _PAGE
        zeros.append(tensor)
    with open(os.path.join(folder, _ZEROS), "wb") as data:
        data.truncate(end)  # a hole: reads as zeros
    outputs = [helper.make_tensor_value_info(name, activations, None) for name in node.output if name]
    graph = helper.make_graph([node], "probe", inputs, outputs, zeros)
    path = os.path.join(folder, "probe.onnx")
    onnx.save(helper.make_model(graph, opset_imports=list(layout.opset_import), ir_version=layout.ir_version), path)
    return path


_PAGE, _ZEROS = 4096, "zeros.bin"


def _nbytes(tensor):
    """The bytes of `tensor`'s values as raw data (4-bit types two a byte)."""
    count = math.prod(tensor.dims)
    if tensor.data_type in (TensorProto.INT4, TensorProto.UINT4):
        return (count + 1) // 2
    return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _probed(layout, node, constants, activations):
    """The optimized model (without data) a session with prepacking on writes of `node` alone (_alone), its
    prepacked copies recorded."""
    from runtime.optimized import layout_session
    with tempfile.TemporaryDirectory(prefix="onnx-lab-probe-") as folder:
        path = _alone(layout, node, constants, activations, folder)
        session = layout_session(path, os.path.join(folder, "layout.onnx"))
        del session
        return onnx.load(os.path.join(folder, "layout.onnx"), load_external_data=False)
