"""The prepacked copies of a table's widening, where the layout was written with prepacking off (issue 57's decision).

onnxruntime's CPU provider widens every float16 / bfloat16 weight of a MatMul to a float32 copy of its own at load,
and with prepacking on (its defaults) the kernel then packs that copy once more: a session that writes a 30-layer
float16 model's layout held 1.30 GiB where one with prepacking off held 0.79 GiB, the same optimized graph either
way. inspect writes such a layout with prepacking off, so no prepacked copy is recorded beside its initializers.
The copies that count, a kernel's packing of a table's widened copy, are then made again here, each alone: the
same op (its attributes, its name) on a float32 initializer of the copy's dims, in a session of the lab's settings
with prepacking on, whose optimized model records what the kernel packed (resident.prepacked_copies). The values
are zeros: how much a kernel packs depends on the weight's dims, not on its values. Other weights are not probed.
"""
import math
import os
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper

WHY = ("written with prepacking off: the CPU provider's float32 widenings of float16 weights, packed again by their "
       "kernels, were held twice while the layout was written; each table copy's packing is probed apart (probed)")

_PACKING = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "FusedMatMul")}  # the float32 weights' packing kernels


def unrecorded(layout, sizes):
    """{"why": WHY, "probed": [{initializer, kernel, node, bytes}]}: the prepacked copies a session with prepacking
    on would record of the float32 initializers of `layout` (an optimized model, ModelProto without data) that hold
    one of `sizes` elements (the tables' copies) and that a packing kernel reads as its weight, each probed alone."""
    from runtime.resident import prepacked_copies
    weights = {t.name: t for t in layout.graph.initializer
               if t.data_type == TensorProto.FLOAT and len(t.dims) == 2 and math.prod(t.dims) in set(sizes or ())}
    probed = []
    for node in layout.graph.node:
        if (node.domain, node.op_type) not in _PACKING or len(node.input) < 2 or node.input[1] not in weights:
            continue
        found = prepacked_copies(_probe(_alone(layout, node, weights[node.input[1]])))
        probed += [dict(p, node=node.name or node.output[0]) for p in found]
    return {"why": WHY, "probed": probed}


def _alone(layout, node, weight):
    """A model of `node` alone, its weight a float32 initializer of `weight`'s dims (zeros), its other inputs the
    graph's inputs; `layout`'s opsets."""
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
              for i, name in enumerate(node.input) if i != 1 and name]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in node.output if name]
    zeros = onnx.numpy_helper.from_array(np.zeros(tuple(weight.dims), np.float32), weight.name)
    graph = helper.make_graph([node], "probe", inputs, outputs, [zeros])
    return helper.make_model(graph, opset_imports=list(layout.opset_import), ir_version=layout.ir_version)


def _probe(model):
    """The optimized model (without data) a session with prepacking on writes of `model`, its prepacked copies
    recorded."""
    from runtime.optimized import layout_session
    with tempfile.TemporaryDirectory(prefix="onnx-lab-probe-") as folder:
        path = os.path.join(folder, "probe.onnx")
        session = layout_session(model, path)
        del session
        return onnx.load(path, load_external_data=False)
