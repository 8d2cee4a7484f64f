"""The matmul weights a graph's MatMul and Gemm nodes read, and those two graphs share: a merged decoder's If
branches both read the decoder's weights from the main graph, and onnxruntime's defaults prepack a constant weight
once per kernel that reads it (retie.branches reads them in place)."""
from onnx import TensorProto

from runtime.model.graph.ops import PLAIN_MATMULS
from runtime.model.read.model import graph_paths


def matmul_weights(graph, model):
    """(node, initializer) for each MatMul / Gemm of `graph` whose weight is a float32 2-D initializer of the main
    graph (a name a body reads from outside; ONNX forbids shadowing, so one name is one tensor)."""
    for node in graph.node:
        if node.op_type in PLAIN_MATMULS and len(node.input) > 1 and node.domain in ("", "ai.onnx"):
            tensor = model.tensors.get(node.input[1])
            if tensor is not None and tensor.data_type == TensorProto.FLOAT and len(tensor.dims) == 2:
                yield node, node.input[1]


def shared_weights(model):
    """{initializer: [graph paths]} of the float32 main-graph initializers that MatMul or Gemm nodes of two or more
    graphs read as their weight: what each of those graphs' kernels prepacks a copy of."""
    homes = {}
    for path, _, graph in graph_paths(model.proto.graph):
        for _, name in matmul_weights(graph, model):
            homes.setdefault(name, set()).add(path)
    return {name: sorted(paths) for name, paths in homes.items() if len(paths) > 1}
