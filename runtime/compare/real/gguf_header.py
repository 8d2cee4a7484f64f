"""A GGUF file's header read by our own checked reader: the metadata compare --model needs and where each tensor's
bytes lie. gguf's GGUFReader builds a numpy view for every part of every field (15 s for Gemma 3's 262144 tokens,
their scores and types, before a tensor is touched); this walks the same bytes with struct, each length checked
against what the file can hold before it is read, and keeps only the keys asked for. The tensors' bytes are then
mapped, and decoded by the gguf package's own dequantize."""
import mmap
import struct
from dataclasses import dataclass

from runtime.model.read.text import InspectError

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
MOST_DIMS = 8  # ggml's own limit is 4


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes lie: its ggml type (a GGMLQuantizationType value), dims as ggml lists them (fastest
    first), and its offset from the start of the file."""
    name: str
    dims: tuple
    ggml_type: int
    offset: int


class _Cursor:
    """Reads little-endian values from the mapped file, each checked to lie inside it."""

    def __init__(self, data, path):
        self.data, self.at, self.path = data, 0, path

    def take(self, size):
        if size < 0 or self.at + size > len(self.data):
            raise InspectError(f"{self.path}: a GGUF header field runs past the end of the file (at byte {self.at})")
        start, self.at = self.at, self.at + size
        return start

    def scalar(self, kind):
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt)))[0]

    def string(self):
        length = self.scalar(10)
        start = self.take(length)
        return bytes(self.data[start:start + length]).decode("utf-8", "replace")

    def value(self, kind, keep, depth=0):
        """A value of GGUF type `kind`: read where `keep`, else skipped (None)."""
        if kind in _SCALARS and keep:
            return self.scalar(kind)
        if kind in _SCALARS:
            self.take(struct.calcsize(_SCALARS[kind]))
            return None
        if kind == _STRING and keep:
            return self.string()
        if kind == _STRING:
            self.take(self.scalar(10))
            return None
        if kind != _ARRAY or depth > 2:
            raise InspectError(f"{self.path}: GGUF value type {kind} is not one this reader knows")
        inner, count = self.scalar(4), self.scalar(10)
        if count > len(self.data) - self.at:  # every element takes a byte at least: no loop past the file's size
            raise InspectError(f"{self.path}: a GGUF array of {count} values in a {len(self.data)}-byte file")
        if inner in _SCALARS and not keep:
            self.take(count * struct.calcsize(_SCALARS[inner]))
            return None
        if inner in _SCALARS:
            fmt = _SCALARS[inner]
            return list(struct.unpack_from(f"<{count}{fmt[1]}", self.data, self.take(count * struct.calcsize(fmt))))
        return [self.value(inner, keep, depth + 1) for _ in range(count)]


def read_header(path, keys):
    """({key: value} of the metadata `keys` the file holds, [TensorInfo]): InspectError for a file that is not a
    little-endian GGUF of version 2 or 3, or whose header does not fit inside it."""
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise InspectError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
    cursor = _Cursor(data, path)
    if bytes(data[:4]) != MAGIC:
        raise InspectError(f"{path}: not a GGUF file")
    cursor.take(4)
    version = cursor.scalar(4)
    if version not in (2, 3):
        raise InspectError(f"{path}: GGUF version {version} (a big-endian file, or one this reader does not know)")
    tensors, count = cursor.scalar(10), cursor.scalar(10)
    found = {}
    for _ in range(count):
        key = cursor.string()
        value = cursor.value(cursor.scalar(4), key in keys or key == "general.alignment")
        if value is not None:
            found[key] = value
    infos = []
    for _ in range(tensors):
        name, rank = cursor.string(), cursor.scalar(4)
        if rank > MOST_DIMS:
            raise InspectError(f"{path}: tensor {name!r} has {rank} dims")
        dims = tuple(cursor.scalar(10) for _ in range(rank))
        infos.append((name, dims, cursor.scalar(4), cursor.scalar(10)))
    alignment = found.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise InspectError(f"{path}: general.alignment {alignment!r} is not a power of two")
    start = -(-cursor.at // alignment) * alignment
    data.close()
    return found, [TensorInfo(n, d, t, start + o) for n, d, t, o in infos]
