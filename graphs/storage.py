"""Write models to disk atomically, with large tables as external data beside the model file."""
import os
import shutil
import tempfile

import onnx

PROTOBUF_LIMIT = 2**31 - 1  # a serialized protobuf message cannot reach 2 GiB
_ALIGN = 65536  # external tensors start on allocation-granularity offsets so onnxruntime can map them
_MARGIN = 64 * 2**20  # room for everything in the model that is not a tensor
# From this size a table goes to external data by default: onnxruntime then maps it from the file instead of
# copying it out of the protobuf, so a session costs 0.07x the table at start rather than 1.07x (BENCHMARKS.md).
EXTERNAL_FROM = 64 * 2**20


def inline_bytes(model):
    """Bytes of raw tensor data the model holds inline."""
    return sum(len(t.raw_data) for t in model.graph.initializer)


def fits_inline(model):
    return inline_bytes(model) + _MARGIN < PROTOBUF_LIMIT


def data_path(path):
    """Where save() puts external data for the model at `path`."""
    return os.fspath(path) + ".data"


def save(model, path, *, external=None, min_external_bytes=1024, overwrite=False, check=True):
    """Write `model` to `path` atomically; returns the paths written.

    external=None moves tensors to `path + ".data"` when one holds EXTERNAL_FROM bytes or more, or the model
    would not fit in a protobuf; True always does (tensors of `min_external_bytes` or more); False never.
    The model passed in is not changed.
    An existing file is refused unless overwrite=True. The model is checked (full_check) before it
    takes its final name, so a file that appears there is complete and valid; check=False skips that, for a
    caller that has run the checker on the same model elsewhere (runtime.inspect, in its isolated child).
    """
    path = os.path.abspath(os.fspath(path))
    if external is None:
        external = not fits_inline(model) or any(len(t.raw_data) >= EXTERNAL_FROM for t in model.graph.initializer)
    targets = [path] + ([data_path(path)] if external else [])
    if not overwrite:
        for target in targets:
            if os.path.lexists(target):
                raise FileExistsError(f"{target} exists; refusing to overwrite it")
    folder = os.path.dirname(path)
    staging = tempfile.mkdtemp(prefix=".saving-", dir=folder)
    try:
        staged = os.path.join(staging, os.path.basename(path))
        if external:
            _write_external(model, staged, min_external_bytes)
        else:
            with open(staged, "wb") as f:
                f.write(model.SerializeToString())
        if check:
            onnx.checker.check_model(staged, full_check=True)
        for target in reversed(targets):  # the data first: once the model file appears, it is whole
            os.replace(os.path.join(staging, os.path.basename(target)), target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return targets


def _write_external(model, staged, min_bytes):
    """Serialize `model` with its large raw tensors moved into `staged + ".data"`, without changing `model`."""
    location = os.path.basename(data_path(staged))
    light = _without_large_tensors(model, min_bytes)
    moved = {t.name: t for t in model.graph.initializer if len(t.raw_data) >= min_bytes}
    with open(data_path(staged), "wb") as data:
        for tensor in light.graph.initializer:
            if tensor.name not in moved:
                continue
            offset = data.tell() + (-data.tell() % _ALIGN)
            data.seek(offset)
            raw = moved[tensor.name].raw_data
            data.write(raw)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(raw)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
    with open(staged, "wb") as f:
        f.write(light.SerializeToString())


def _copy_fields(source, target, skip):
    """Copy every set field of one protobuf message into another, except the field named `skip`."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if field.is_repeated:
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def _without_large_tensors(model, min_bytes):
    """A copy of `model` whose large initializers are empty shells (name, type, dims kept): no large copy."""
    shell = onnx.ModelProto()
    _copy_fields(model, shell, skip="graph")
    _copy_fields(model.graph, shell.graph, skip="initializer")
    for tensor in model.graph.initializer:
        copy = shell.graph.initializer.add()
        if len(tensor.raw_data) >= min_bytes:
            copy.name, copy.data_type, copy.doc_string = tensor.name, tensor.data_type, tensor.doc_string
            copy.dims.extend(tensor.dims)
        else:
            copy.CopyFrom(tensor)
    return shell
