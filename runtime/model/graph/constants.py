"""Small constants a graph computes from its initializers, resolved without running it."""
import math

import numpy as np
from onnx import TensorProto, numpy_helper


def constant(name, producer, model, most=8):
    """The values of a small constant (an initializer, or a Constant node's value / value_ints / value_float) as a
    flat numpy array of at most `most` elements, or None."""
    tensor = model.tensors.get(name)
    if tensor is not None:
        values = tensor.values() if tensor.elements <= most else None
        return None if values is None else np.asarray(values).reshape(-1)
    node = producer.get(name)
    if node is None or node.op_type != "Constant" or len(node.attribute) != 1:
        return None
    value = node.attribute[0]
    if value.name in ("value_ints", "value_floats"):
        values = np.asarray(value.ints if value.name == "value_ints" else value.floats)
    elif value.name in ("value_int", "value_float"):
        values = np.asarray([value.i if value.name == "value_int" else value.f])
    elif value.name == "value" and math.prod(value.t.dims) <= most and value.t.data_location != TensorProto.EXTERNAL:
        values = numpy_helper.to_array(value.t).reshape(-1)  # external data: not read (onnx would resolve it
                                                              # against the working directory, not the model's)
    else:
        return None
    return values if values.size <= most else None


def small_ints(name, producer, model):
    """The values of a small int64 constant as a list, or None."""
    values = constant(name, producer, model)
    return [int(v) for v in values] if values is not None and values.dtype == np.int64 else None
