"""Write models to disk atomically, with large tables as external data beside the model file."""
import contextlib
import math
import os
import shutil
import signal
import tempfile

import onnx

from graphs.arrays import write_array

PROTOBUF_LIMIT = 2**31 - 1  # a serialized protobuf message cannot reach 2 GiB
ALIGN = 65536  # large external tensors start on allocation-granularity offsets so onnxruntime can map them
ALIGN_FROM = 2**20  # smaller ones are read, not mapped: 16-byte offsets, so a norm weight costs no 64 KiB slot
_MARGIN = 64 * 2**20  # room for everything in the model that is not a tensor
# From this size a table goes to external data by default: onnxruntime then maps it from the file instead of
# copying it out of the protobuf, so a session costs 0.07x the table at start rather than 1.07x (BENCHMARKS.md).
EXTERNAL_FROM = 64 * 2**20


def inline_bytes(model):
    """Bytes of tensor data the model holds inline (from dims: reading raw_data's length would copy it)."""
    return sum(_size(t) for t in model.graph.initializer)


def _size(tensor):
    """Bytes of a tensor's data: dims x itemsize for raw data, the serialized size otherwise (small typed data)."""
    if tensor.HasField("raw_data"):
        return raw_bytes(tensor.data_type, tensor.dims)
    return tensor.ByteSize()


# Bits per element of each ONNX type with a fixed size (4-bit types pack two values a byte).
BITS = {
    onnx.TensorProto.FLOAT: 32, onnx.TensorProto.UINT8: 8, onnx.TensorProto.INT8: 8, onnx.TensorProto.UINT16: 16,
    onnx.TensorProto.INT16: 16, onnx.TensorProto.INT32: 32, onnx.TensorProto.INT64: 64, onnx.TensorProto.BOOL: 8,
    onnx.TensorProto.FLOAT16: 16, onnx.TensorProto.DOUBLE: 64, onnx.TensorProto.UINT32: 32, onnx.TensorProto.UINT64: 64,
    onnx.TensorProto.COMPLEX64: 64, onnx.TensorProto.COMPLEX128: 128, onnx.TensorProto.BFLOAT16: 16,
    onnx.TensorProto.FLOAT8E4M3FN: 8, onnx.TensorProto.FLOAT8E4M3FNUZ: 8, onnx.TensorProto.FLOAT8E5M2: 8,
    onnx.TensorProto.FLOAT8E5M2FNUZ: 8, onnx.TensorProto.FLOAT8E8M0: 8,
    onnx.TensorProto.UINT4: 4, onnx.TensorProto.INT4: 4, onnx.TensorProto.FLOAT4E2M1: 4,  # two codes a byte
}


def raw_bytes(data_type, dims):
    """Bytes of raw data a tensor of this type and dims holds (4-bit types pack two values a byte)."""
    return (math.prod(dims) * BITS[data_type] + 7) // 8


def fits_inline(model):
    return inline_bytes(model) + _MARGIN < PROTOBUF_LIMIT


def data_path(path):
    """Where save() puts external data for the model at `path`."""
    return os.fspath(path) + ".data"


def save(model, path, *, external=None, min_external_bytes=1024, overwrite=False, check=True, sources=None):
    """Write `model` to `path` atomically; returns the paths written.

    external=None moves tensors to `path + ".data"` when one holds EXTERNAL_FROM bytes or more, or the model
    would not fit in a protobuf; True always does (tensors of `min_external_bytes` or more); False never.
    The model passed in is not changed.
    An existing file is refused unless overwrite=True. The model is checked (full_check) before it
    takes its final name, so a file that appears there is complete and valid; check=False skips that, for a
    caller that has run the checker on the same model elsewhere (runtime.inspect, in its isolated child).
    `sources` ({initializer name: array}) gives the data of initializers the model holds as shells (name, type,
    dims, or a stale external reference): each array (a memory map, a transposed view) is written to the data file
    in chunks, so a table larger than memory allows passes through without a copy; it implies external=True.
    """
    staged = stage(model, path, external=external, min_external_bytes=min_external_bytes, overwrite=overwrite,
                   sources=sources)
    try:
        if check:
            onnx.checker.check_model(staged.path, full_check=True)
        return staged.place(overwrite)
    finally:
        staged.discard()


class Staged:
    """A model written under its final file names in a staging folder beside them (stage()): `path` is the staged
    model, which can be read and run first; place() gives exactly those files their names; discard() removes the
    staging folder (what place() linked into place stays)."""

    def __init__(self, staging, path, targets):
        self.staging, self.path, self.targets = staging, path, targets

    def place(self, overwrite=False):
        """Link the staged files into place, the data first (_place); returns the paths placed."""
        _place(self.staging, self.targets, overwrite)
        return self.targets

    def discard(self):
        shutil.rmtree(self.staging, ignore_errors=True)


def stage(model, path, *, external=None, min_external_bytes=1024, overwrite=False, sources=None):
    """save()'s first half, its arguments the same: the model written, unchecked, in a new staging folder beside
    `path` (`.saving-<pid>-*`, which runtime.inspect.sandbox.guard removes if the process dies); a Staged. An
    existing file at `path` (or its data file) is refused unless overwrite=True."""
    path = os.path.abspath(os.fspath(path))
    sources = sources or {}
    if sources:
        external = True
    elif external is None:
        external = not fits_inline(model) or any(_size(t) >= EXTERNAL_FROM for t in model.graph.initializer)
    targets = [path] + ([data_path(path)] if external else [])
    if not overwrite:
        for target in targets:
            if os.path.lexists(target):
                raise FileExistsError(f"{target} exists; refusing to overwrite it")
    staging = tempfile.mkdtemp(prefix=f".saving-{os.getpid()}-", dir=os.path.dirname(path))  # the pid: the guard's
    staged = Staged(staging, os.path.join(staging, os.path.basename(path)), targets)
    try:
        if external:
            _write_external(model, staged.path, min_external_bytes, sources)
        else:
            with open(staged.path, "wb") as f:
                f.write(model.SerializeToString())
    except BaseException:
        staged.discard()
        raise
    return staged


def _place(staging, targets, overwrite):
    """Give the staged files their names, the data first (once the model file appears, it is whole). Without
    `overwrite` each is hard-linked into place, which fails rather than replace a file that appeared meanwhile
    (another writer racing for the same name): what this call placed is then removed and FileExistsError raised.
    Anything else that stops it between the two (a signal, a deadline) takes back what it placed too."""
    placed = []
    try:
        for target in reversed(targets):
            staged = os.path.join(staging, os.path.basename(target))
            if overwrite:
                os.replace(staged, target)
                continue
            try:
                os.link(staged, target)
            except FileExistsError:
                raise FileExistsError(f"{target} appeared while writing; refusing to overwrite it") from None
            except OSError:  # a filesystem without hard links: checked above, replaced now
                if os.path.lexists(target):
                    raise FileExistsError(f"{target} exists; refusing to overwrite it") from None
                os.replace(staged, target)
            placed.append(target)
    except BaseException:
        for done in placed:  # a data file without its model is not left behind
            os.remove(done)
        raise


def is_large(tensor, min_bytes):
    """A raw tensor of `min_bytes` or more, measured without copying its bytes out of the protobuf."""
    return tensor.HasField("raw_data") and _size(tensor) >= min_bytes


def check(model, min_bytes=1 << 20, lengths=None):
    """onnx.checker.check_model(full_check=True) on `model`, at any size, without serializing its large tensors.

    Each raw tensor of `min_bytes` or more is first checked here to hold exactly dims x itemsize bytes; the checker
    then sees it as external data over a file of holes of that length (it reads names, types and dims, never the
    values), so a 600 MB model is checked in the time a small one takes, and one past 2 GiB can be checked too.
    `lengths` {initializer name: len(raw_data)}, from a caller that just wrote those bytes, saves reading each
    back (a read copies the whole tensor out of the protobuf).
    """
    lengths = lengths or {}
    shell = without_large_tensors(model, min_bytes)
    large = {t.name: t for t in model.graph.initializer if is_large(t, min_bytes)}
    longest = 0
    for tensor in shell.graph.initializer:
        if tensor.name not in large:
            continue
        length = lengths[tensor.name] if tensor.name in lengths else len(large[tensor.name].raw_data)
        if length != raw_bytes(tensor.data_type, tensor.dims):
            raise onnx.checker.ValidationError(f"initializer {tensor.name!r}: {length} bytes of raw data for dims "
                                               f"{list(tensor.dims)}")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", "holes.bin"), ("offset", "0"), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        longest = max(longest, length)
    with _scratch("onnx-lab-check-") as folder:
        with open(os.path.join(folder, "holes.bin"), "wb") as f:
            f.truncate(longest)  # sparse: no disk, no memory
        path = os.path.join(folder, "shell.onnx")
        with open(path, "wb") as f:
            f.write(shell.SerializeToString())
        onnx.checker.check_model(path, full_check=True)


@contextlib.contextmanager
def _scratch(prefix):
    """A temporary folder, removed on the way out with SIGINT and SIGTERM held off meanwhile (they land once it is
    gone). One landing inside shutil.rmtree's descriptor walk raised there, and rmtree's own cleanup then closed
    that descriptor a second time: the command ended on that EBADF, not on its one line."""
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        yield folder
    finally:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            shutil.rmtree(folder)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _write_external(model, staged, min_bytes, sources):
    """Serialize `model` with its large raw tensors, and those in `sources`, moved into `staged + ".data"`, without
    changing `model`."""
    location = os.path.basename(data_path(staged))
    light = without_large_tensors(model, min_bytes)
    moved = {t.name: t for t in model.graph.initializer if is_large(t, min_bytes)}
    with open(data_path(staged), "wb") as data:
        for tensor in light.graph.initializer:
            if tensor.name not in moved and tensor.name not in sources:
                continue
            size = sources[tensor.name].nbytes if tensor.name in sources else len(moved[tensor.name].raw_data)
            align = ALIGN if size >= ALIGN_FROM else 16
            offset = data.tell() + (-data.tell() % align)
            data.seek(offset)
            if tensor.name in sources:
                write_array(data, sources[tensor.name], tensor)
                tensor.ClearField("raw_data")
                del tensor.external_data[:]
            else:
                data.write(moved[tensor.name].raw_data)
            length = data.tell() - offset
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
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


def without_large_tensors(model, min_bytes):
    """A copy of `model` whose large initializers are empty shells (name, type, dims kept): no large copy."""
    shell = onnx.ModelProto()
    _copy_fields(model, shell, skip="graph")
    _copy_fields(model.graph, shell.graph, skip="initializer")
    for tensor in model.graph.initializer:
        copy = shell.graph.initializer.add()
        if is_large(tensor, min_bytes):
            copy.name, copy.data_type, copy.doc_string = tensor.name, tensor.data_type, tensor.doc_string
            copy.dims.extend(tensor.dims)
        else:
            copy.CopyFrom(tensor)
    return shell
