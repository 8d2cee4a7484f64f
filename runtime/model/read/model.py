"""Reading a model file nobody vouched for: every tensor checked before anything large is touched.

The rules follow CPython's tarfile filters and onnx's own location check: each external-data path is
resolved and refused if it leaves the model's folder, before it is opened; each declared size is checked
against the file that must hold it before memory is reserved; tensor data stays on disk (memory-mapped)
until a comparison reads it. That holds for an inline model too: the file is read as a shell (runtime.model.read.
wire), each large tensor's raw data left where it lies in the file (Tensor.stored) and mapped from there when read.
"""
import math
import os

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

from graphs.bodies import graph_paths, label  # noqa: F401 - how inspect names graphs and nodes, given from here too
from graphs.storage import (
    BITS,  # bits per element of each type that can be sized; a type not listed is a finding
)
from runtime.model.read import external, paths, wire
from runtime.model.read.text import InspectError, type_name

FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)  # the float types
BYTE_CODES = (TensorProto.INT8, TensorProto.UINT8)  # integer codes a byte each
CODES = BYTE_CODES + (TensorProto.INT4, TensorProto.UINT4)  # and the packed 4-bit ones
_MAX_ELEMENTS = 2**62  # past this a product of dims is nonsense whatever the file holds


UNWRITTEN = ("", 0, 0)  # Tensor.external of a tensor whose data was never written (load(layout_only=True))


class Tensor:
    """One initializer as checked: name, type, dims, bytes, and where its data lies (never loaded here): `external`
    (path, offset, length) in an external data file, or None where the model file holds it inline; `stored` the
    same for an inline tensor whose raw data the shell left in the model file (wire.LAZY_FROM bytes or more), else
    None (`proto` then holds its data)."""

    def __init__(self, proto, nbytes, external=None, stored=None):
        self.proto, self.name, self.data_type = proto, proto.name, proto.data_type
        self.dims, self.nbytes, self.external = [int(d) for d in proto.dims], nbytes, external
        self.stored = stored

    @property
    def type_name(self):
        """'float32', 'bfloat16', 'int4', ... as numpy / ml_dtypes names them."""
        return np.dtype(helper.tensor_dtype_to_np_dtype(self.data_type)).name

    @property
    def elements(self):
        return math.prod(self.dims)

    def values(self):
        """The tensor as a read-only array, memory-mapped when external; None for packed sub-byte types."""
        if BITS[self.data_type] < 8:
            return None
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(self.data_type))
        if self.elements == 0:
            return np.empty(self.dims, dtype)
        self._written()
        if (self.external or self.stored) is not None:
            path, offset, _ = self.external or self.stored
            return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(self.dims))
        if self.proto.HasField("raw_data"):
            return np.frombuffer(self.proto.raw_data, dtype=dtype).reshape(self.dims)
        return numpy_helper.to_array(self.proto)  # typed fields: already in memory, sizes checked

    def raw(self):
        """The stored bytes (external: memory-mapped), for byte-for-byte comparison of any type."""
        self._written()
        if (self.external or self.stored) is not None:
            path, offset, length = self.external or self.stored
            return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(length,)) if length else b""
        if self.proto.HasField("raw_data"):
            return np.frombuffer(self.proto.raw_data, np.uint8)
        return np.ascontiguousarray(self.values()).view(np.uint8).reshape(-1)

    def _written(self):
        if self.external is UNWRITTEN:  # a caller's mistake, not the model's: load(layout_only=True) promised none
            raise RuntimeError(f"initializer {self.name!r}: its data was not written (a layout-only load)")


class Model:
    """A parsed model whose every tensor passed `check_tensor`: proto (the shell: wire.read's), {name: Tensor} of the
    main graph's initializers, `bodies` {graph path (graph_paths): {name: Tensor}} of its subgraphs' own, bytes on
    disk; `checked` says which file and files were checked: {path, size, identity: [device, inode, size, mtime in
    ns], digest (the shell's), lazy (whether the shell left raw data in the file), folder, root (where the file must
    lie, or None), files: {path: [device, inode, size]}} (runtime.model.read.checked.source hands onnxruntime that
    file and nothing else)."""

    def __init__(self, path, proto, tensors, file_bytes, folder, checked):
        self.path, self.proto, self.tensors, self.file_bytes, self.folder = path, proto, tensors, file_bytes, folder
        self.checked = checked


_TYPED = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def check_tensor(tensor, folder, files, root=None, layout_only=False, own=None):
    """A Tensor for `tensor` if its type, dims and data agree; else InspectError naming what is wrong. External
    data must lie inside `root` (default `folder`); with `layout_only`, it was never written: its length is
    checked against the dims, no file opened, and the Tensor's data cannot be read (external is UNWRITTEN).
    `own`: (the model file's real path, the wire.Shell it was read as), whose raw data left in the file is the
    tensor's inline data (Tensor.stored)."""
    what = f"initializer {tensor.name!r}"
    if tensor.data_type not in BITS:
        raise InspectError(f"{what}: data type {type_name(tensor)} is unknown or unsupported here")
    if any(d < 0 for d in tensor.dims):
        raise InspectError(f"{what}: negative dimension in {list(tensor.dims)}")
    elements = 1
    for d in tensor.dims:
        elements *= d
        if elements > _MAX_ELEMENTS:
            raise InspectError(f"{what}: dims {list(tensor.dims)} declare more elements than any file holds")
    nbytes = (elements * BITS[tensor.data_type] + 7) // 8
    if tensor.HasField("segment"):
        raise InspectError(f"{what}: segmented tensors are not supported")
    if tensor.data_location == TensorProto.EXTERNAL:
        stored = _stored(tensor, folder, own) if own else None
        if stored is not None:
            if stored[2] != nbytes:
                raise InspectError(f"{what}: raw data holds {stored[2]} bytes, dims {list(tensor.dims)} of "
                                   f"{type_name(tensor)} need {nbytes}")
            return Tensor(tensor, nbytes, stored=stored)
        if layout_only:
            lengths = [e.value for e in tensor.external_data if e.key == "length"]
            if lengths and lengths[0] != str(nbytes):
                raise InspectError(f"{what}: external data length {lengths[0]} but its dims need {nbytes} bytes")
            return Tensor(tensor, nbytes, UNWRITTEN)
        return Tensor(tensor, nbytes, external.located(tensor, folder, nbytes, files, root))
    if tensor.data_location != TensorProto.DEFAULT:
        raise InspectError(f"{what}: unknown data_location {tensor.data_location}")
    if tensor.HasField("raw_data"):
        if len(tensor.raw_data) != nbytes:
            raise InspectError(f"{what}: raw data holds {len(tensor.raw_data)} bytes, dims {list(tensor.dims)} "
                               f"of {type_name(tensor)} need {nbytes}")
        return Tensor(tensor, nbytes)
    typed = sum(len(getattr(tensor, field)) for field in _TYPED)
    if typed == 0 and elements:
        raise InspectError(f"{what}: dims {list(tensor.dims)} but no data")
    if typed > 2 * elements:  # two entries an element at most (complex); packed types hold fewer
        raise InspectError(f"{what}: {typed} stored values for dims {list(tensor.dims)}")
    if elements:
        try:
            values = numpy_helper.to_array(tensor)  # small: bounded by what the file holds
        except Exception as e:  # noqa: BLE001 - any failure here is a malformed tensor
            raise InspectError(f"{what}: its data does not match dims {list(tensor.dims)} of "
                               f"{type_name(tensor)} ({type(e).__name__})") from None
        if values.size != elements:
            raise InspectError(f"{what}: {values.size} values for dims {list(tensor.dims)}")
    return Tensor(tensor, nbytes)


def _stored(tensor, folder, own):
    """(path, offset, length) of the raw data wire.read left in the model file for `tensor` (its external data names
    the model file itself, at an offset and length the shell recorded), else None."""
    entries = {e.key: e.value for e in tensor.external_data}
    path, shell = own
    if len(entries) != 3 or len(tensor.external_data) != 3 or not entries.get("offset", "").isdigit():
        return None
    offset, length = int(entries["offset"]), entries.get("length")
    if shell.lazy.get(offset) is None or str(shell.lazy[offset]) != length:
        return None
    if os.path.realpath(os.path.join(folder, entries.get("location", ""))) != path:
        return None
    return path, offset, int(length)


def _bodies(graph, functions=()):
    """`graph`, every subgraph in it (If / Loop / Scan bodies, at any depth) and the model's `functions`' bodies,
    each once."""
    for root in (graph, *functions):  # a function's body holds nodes like a graph's
        yield from (g for _, _, g in graph_paths(root))


def all_tensors(graph, functions=()):
    """Every TensorProto in `graph` and its subgraphs, and in the bodies of the model's `functions`: initializers,
    sparse parts, attribute tensors (onnxruntime inlines a function's nodes, Constants and all)."""
    for g in _bodies(graph, functions):
        yield from ((t, g is graph) for t in getattr(g, "initializer", ()))
        for sparse in getattr(g, "sparse_initializer", ()):
            yield from ((sparse.values, False), (sparse.indices, False))
        for node in g.node:
            for a in node.attribute:
                if a.HasField("t"):
                    yield a.t, False
                yield from ((t, False) for t in a.tensors)
                if a.HasField("sparse_tensor"):
                    yield from ((a.sparse_tensor.values, False), (a.sparse_tensor.indices, False))
                for s in a.sparse_tensors:
                    yield from ((s.values, False), (s.indices, False))


def _names_are_text(graph, functions=()):
    """InspectError unless every name in the graph, its subgraphs and the model's functions is text: protobuf
    hands a string field that is not valid UTF-8 over as bytes, and ONNX requires UTF-8."""
    for g in _bodies(graph, functions):
        values = list(getattr(g, "input", ())) + list(getattr(g, "output", ())) + list(getattr(g, "value_info", ()))
        fields = [t.name for t in getattr(g, "initializer", ())] + [getattr(v, "name", v) for v in values]
        for node in g.node:
            fields += [node.name, node.op_type, node.domain, *node.input, *node.output]
        bad = next((f for f in fields if isinstance(f, bytes)), None)
        if bad is not None:
            raise InspectError(f"a name is not valid UTF-8 ({bad[:60]!r}): not a valid ONNX model")


def load(path, folder=None, data=None, root=None, layout_only=False):
    """Read `path` as a shell (wire.read) and check every tensor in it (main graph, subgraphs, attributes): a Model,
    or InspectError.

    `folder` is where external data may live (default: the model's own folder). Nothing outside it is opened,
    except in a hub cache snapshot, whose data files may resolve anywhere in its repository folder.
    `root`: where the model file itself must really lie when it is opened (a folder's root: a link swapped in
    after the folder was checked is refused); default: anywhere. `data`: the file as read already (a wire.Shell:
    runtime.model.read.checked.source's), checked instead of reading it again. `layout_only`: a model whose
    external data was never written (an optimized model written for its layout:
    runtime.optimized.write_optimized_layout), its tensors sized from their dims and never read.
    """
    shell = data if data is not None else wire.read_file(path, root)
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(shell.data)
    except (DecodeError, RecursionError, ValueError):
        raise InspectError(f"{path}: not an ONNX model (it does not parse; truncated?)") from None
    if proto.ir_version <= 0 or not proto.opset_import or not proto.HasField("graph"):
        raise InspectError(f"{path}: not an ONNX model (no IR version, opset or graph)")
    _names_are_text(proto.graph, proto.functions)
    if folder is None:  # where the OS finds its data: beside the file's real path, or in its hub snapshot
        beside = os.path.dirname(os.path.abspath(path))
        folder = beside if paths.hub_root(beside) else os.path.dirname(os.path.realpath(path))
    folder = os.path.realpath(folder)
    data_root = paths.hub_root(folder) or folder
    files, tensors, checked_of, own = {}, {}, {}, (os.path.realpath(path), shell)
    for tensor, top in all_tensors(proto.graph, proto.functions):
        checked = checked_of[id(tensor)] = check_tensor(tensor, folder, files, data_root, layout_only, own)
        if top:
            if tensor.name in tensors:
                raise InspectError(f"initializer {tensor.name!r} is defined twice")
            tensors[tensor.name] = checked
    bodies = {path: {t.name: checked_of[id(t)] for t in g.initializer}
              for path, parent, g in graph_paths(proto.graph) if parent is not None and len(g.initializer)}
    external.not_sparse(files)
    identities = {name: [info.st_dev, info.st_ino, info.st_size] for info, _, names in files.values() for name in names}
    checked = {"path": os.fspath(path), "size": shell.size, "identity": shell.identity, "digest": shell.digest,
               "lazy": bool(shell.lazy), "folder": folder, "root": root, "files": dict(sorted(identities.items()))}
    model = Model(path, proto, tensors, shell.size + sum(info.st_size for info, *_ in files.values()), folder, checked)
    model.bodies = bodies
    return model
