"""A model file read as a small shell: the ModelProto's bytes with each large inline tensor's raw data left where it
lies in the file, named as external data in the file itself.

protobuf's own parser would hold every tensor's bytes (an inline model is most of its file) and its caller the file
too. Here the messages that can hold a tensor (ModelProto.graph and functions, GraphProto.node, initializer and
sparse_initializer, NodeProto.attribute, AttributeProto.t, g, tensors, graphs, sparse_tensor(s), FunctionProto.node,
SparseTensorProto.values and indices) are walked field by field where they are LAZY_FROM bytes or more (a smaller one
cannot hold a large tensor, and is copied as it is); every other field is copied as it is, so protobuf parses the
shell as it would the file, less those tensors' data. A TensorProto's raw_data (field 9) of LAZY_FROM bytes or more
is skipped (not read) and the tensor given data_location EXTERNAL and external_data {location: the file's name,
offset, length} instead: onnx's external-data form, which runtime.model.read.model checks and maps like any data
file's. Reading a 600 MB model so reads a few MB, front to back.

The bytes are untrusted: every length is checked against what is left of its message and of the file, varints
are at most ten bytes, nesting is walked to _DEPTH levels (deeper messages are copied as they are, for protobuf to
judge), and what cannot be a protobuf message is InspectError, one line."""
import hashlib
import os

from runtime.model.read import paths
from runtime.model.read.text import InspectError

SPARSE_FROM = 64 * 2**20  # below this, holes (alignment padding) are not worth a finding
_PROTOBUF_MOST = 2**31 - 1  # protobuf's limit on a serialized message
LAZY_FROM = 64 * 2**10  # raw data this long or longer is left in the file
_DEPTH = 32  # messages walked inside one another at most
_WINDOW = 64 * 2**10  # bytes read at a time

_MODEL, _GRAPH, _NODE, _ATTRIBUTE, _FUNCTION, _SPARSE, _TENSOR = range(7)
_INSIDE = {  # field number -> the kind of message it holds, for each message walked (onnx.proto)
    _MODEL: {7: _GRAPH, 25: _FUNCTION},
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},
    _NODE: {5: _ATTRIBUTE},
    _ATTRIBUTE: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _FUNCTION: {7: _NODE},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},
}
_ONCE = {_ATTRIBUTE: {5}, _SPARSE: {1, 2}}  # the tensor fields that are not repeated
_RAW_DATA, _EXTERNAL_DATA, _DATA_LOCATION = 9, 13, 14  # TensorProto's fields
_EXTERNAL = 1  # TensorProto.EXTERNAL


class Shell:
    """What read() makes of a file: `data` (the shell's serialized bytes, for protobuf), `lazy` {offset: length} of
    each raw data left in the file, `size` (the file's bytes) and `digest` (the shell's hex digest: what the file
    says besides those raw data)."""

    def __init__(self, data, lazy, size):
        self.data, self.lazy, self.size = data, lazy, size
        self.identity = None  # [device, inode, size, mtime in ns] of the file, where read_open read it
        self.digest = hashlib.blake2b(data, digest_size=16).hexdigest()


def read(f, size, location):
    """The Shell of the `size`-byte file open as `f` (unbuffered, at its start), its lazy tensors named as data in
    `location` (the file's own name, relative to its folder). InspectError when it is not a protobuf message."""
    stream = _Stream(f, size)
    pieces, lazy = [], {}
    try:
        _message(stream, size, _MODEL, 0, pieces, lazy, location)
    except _Malformed:
        raise InspectError("not an ONNX model (it does not parse; truncated?)") from None
    return Shell(b"".join(pieces), lazy, size)


def read_file(path, root=None):
    """The Shell of the model file at `path` (inside `root`, if given), its `identity` [device, inode, size,
    mtime in ns] as opened; refused unread if it is past protobuf's 2 GiB or sparse."""
    info, fd = paths.open_regular(path, root, os.fspath(path))
    with open(fd, "rb", buffering=0) as f:  # read from the descriptor checked: what is read is what was stat'ed
        return read_open(f, info, path)


def read_open(f, info, path):
    """read_file's answer for the file open as `f` (unbuffered), `info` its os.fstat."""
    size = info.st_size
    if size > _PROTOBUF_MOST:
        raise InspectError(f"{path}: {size} bytes, more than a protobuf holds (2 GiB; larger tensors go in external "
                           "data): not an ONNX model file")
    if size > SPARSE_FROM and info.st_blocks * 512 < size // 2:
        raise InspectError(f"{path}: holds {info.st_blocks * 512} bytes on disk but is {size} long: a sparse file; "
                           "refused")
    try:
        shell = read(f, size, os.path.basename(path))
    except InspectError as e:
        raise InspectError(f"{path}: {e}") from None
    shell.identity = [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns]
    return shell


class _Malformed(Exception):
    """Bytes that are no protobuf message: a length past its message's end, a varint too long, a wire type unknown."""


class _Stream:
    """The file from its start, read a window at a time; raw data skipped is not read."""

    def __init__(self, f, size):
        self.f, self.size = f, size
        self.buffer, self.at, self.base = b"", 0, 0  # buffer holds the file's bytes from `base`; `at` is in it

    @property
    def position(self):
        return self.base + self.at

    def _have(self, n):
        while self.at + n > len(self.buffer):
            if self.position + n > self.size:
                raise _Malformed
            rest = self.buffer[self.at:]
            more = self.f.read(max(n - len(rest), min(_WINDOW, self.size - self.position - len(rest))))
            if not more:
                raise _Malformed  # shorter than it was when its size was taken
            self.base, self.buffer, self.at = self.position, rest + more, 0

    def take(self, n):
        """The next `n` bytes."""
        self._have(n)
        self.at += n
        return self.buffer[self.at - n:self.at]

    def skip(self, n):
        """Move past the next `n` bytes without reading them."""
        if self.position + n > self.size:
            raise _Malformed
        if self.at + n <= len(self.buffer):
            self.at += n
            return
        self.base, self.buffer, self.at = self.position + n, b"", 0
        self.f.seek(self.base)

    def varint(self):
        self._have(min(10, self.size - self.position))
        value, shift = 0, 0
        for i in range(10):
            if self.at + i >= len(self.buffer):
                raise _Malformed
            byte = self.buffer[self.at + i]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                self.at += i + 1
                if value >= 2**64:
                    raise _Malformed
                return value
            shift += 7
        raise _Malformed


def _varint(value):
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(stream):
    """(the next varint's bytes, its value)."""
    start = stream.position
    value = stream.varint()
    return stream.buffer[stream.at - (stream.position - start):stream.at], value


def _field(stream, end):
    """(field number, wire type, the tag's bytes) of the next field, which must start before `end`."""
    tag, value = _read_varint(stream)
    if stream.position > end or value >> 3 == 0:
        raise _Malformed
    return value >> 3, value & 7, tag


def _scalar(stream, wire):
    """(the bytes, the value or None) of a field's value of wire type `wire`, which is not length-delimited."""
    if wire == 0:
        return _read_varint(stream)
    if wire in (1, 5):
        return stream.take(8 if wire == 1 else 4), None
    raise _Malformed  # groups (3, 4) are in no ONNX message; 6 and 7 in no protobuf


def _message(stream, end, kind, depth, pieces, lazy, location):
    """Walk the fields of a message of `kind` up to file offset `end`, appending its shell's bytes to `pieces`."""
    if kind == _TENSOR:
        return _tensor(stream, end, pieces, lazy, location)
    inside, once, seen = _INSIDE[kind], _ONCE.get(kind, ()), set()
    while stream.position < end:
        number, wire, tag = _field(stream, end)
        if wire != 2:
            pieces += [tag, _scalar(stream, wire)[0]]
            continue
        length = stream.varint()
        if stream.position + length > end:
            raise _Malformed
        if number in once:
            if number in seen:  # protobuf would merge the two: a tensor's raw data would be the one left out
                raise InspectError("a tensor given twice where one is (an attribute's, a sparse tensor's): not a "
                                   "valid ONNX model")
            seen.add(number)
        if number not in inside or length < LAZY_FROM or depth >= _DEPTH:
            pieces += [tag, _varint(length), stream.take(length)]
            continue
        inner = []
        _message(stream, stream.position + length, inside[number], depth + 1, inner, lazy, location)
        pieces += [tag, _varint(sum(len(p) for p in inner))] + inner
    if stream.position != end:
        raise _Malformed


def _tensor(stream, end, pieces, lazy, location):
    """A TensorProto's fields up to `end`: its raw data left in the file where it is long (the last raw_data field
    is the one protobuf keeps), named as external data there."""
    fields, raw, external, located = [], None, False, None
    while stream.position < end:
        number, wire, tag = _field(stream, end)
        if wire != 2:
            value, number_value = _scalar(stream, wire)
            located = number_value if number == _DATA_LOCATION and wire == 0 else located  # the last one holds
            fields.append((-number, [tag, value]))  # not a raw_data field, whatever its number
            continue
        length = stream.varint()
        if stream.position + length > end:
            raise _Malformed
        external |= number == _EXTERNAL_DATA
        if number == _RAW_DATA and length >= LAZY_FROM:
            raw = (stream.position, length)
            stream.skip(length)
            fields.append((number, None))
            continue
        fields.append((number, [tag, _varint(length), stream.take(length)]))
    if stream.position != end:
        raise _Malformed
    last_raw = max((i for i, (number, _) in enumerate(fields) if number == _RAW_DATA), default=None)
    skipped = last_raw is not None and fields[last_raw][1] is None
    if skipped and (external or located):
        raise InspectError("a tensor holds long raw data and external data or a data_location: not a valid ONNX "
                           "model")
    for i, (number, held) in enumerate(fields):
        if number != _RAW_DATA or i == last_raw:
            pieces += held or []
    if skipped:
        offset, length = raw
        lazy[offset] = length
        pieces += [_varint(_DATA_LOCATION << 3), _varint(_EXTERNAL)]
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
            entry = _string(1, key.encode()) + _string(2, value.encode())
            pieces.append(_string(_EXTERNAL_DATA, entry))


def _string(number, data):
    return _varint(number << 3 | 2) + _varint(len(data)) + data
