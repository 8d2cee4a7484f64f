"""External data checked before it is opened: each location resolved and refused if it leaves the model's folder
(or a hub snapshot's repository), each offset and length against the file that must hold them, and a data file
that declares far more than it holds on disk (a sparse file) refused."""
import os

from runtime.model.read import paths, wire
from runtime.model.read.text import InspectError, type_name

_ORT_MEMORY_MARKER = "_ORT_MEM_ADDR_"  # onnxruntime reads such a "location" from process memory


def external_path(folder, location, name, root=None):
    """The real path of external-data `location` (relative to `folder`) if it names a file inside `root` (default
    `folder`; a hub snapshot's repository folder, whose data files are links into its blobs/); else InspectError."""
    odd = [c for c in location if ord(c) < 32 or c in "\\\x7f"]
    if not location or odd or _ORT_MEMORY_MARKER in location:
        raise InspectError(f"initializer {name!r}: external data location {location!r} is empty or holds odd "
                           "characters; refused")
    if os.path.isabs(location):
        raise InspectError(f"initializer {name!r}: external data path {location!r} is not relative to the "
                           "model's folder; refused")
    path = os.path.realpath(os.path.join(folder, location))
    if not paths.inside(path, root or folder):
        raise InspectError(f"initializer {name!r}: external data path {location!r} escapes the model's folder; "
                           "refused")
    return path


def _count(value, key, name):
    if not (value.isascii() and value.isdigit() and len(value) <= 19):
        raise InspectError(f"initializer {name!r}: external data {key} {value!r} is not a non-negative integer")
    return int(value)


def located(tensor, folder, nbytes, files, root):
    """(path, offset, length) of an external tensor, every number checked against the file; the file is recorded
    in `files` ({real path: [its stat, bytes its tensors declare, the names onnxruntime opens]})."""
    info = {}
    for entry in tensor.external_data:
        if entry.key in info:
            raise InspectError(f"initializer {tensor.name!r}: external data key {entry.key!r} given twice")
        info[entry.key] = entry.value
    path = external_path(folder, info.get("location", ""), tensor.name, root)
    offset = _count(info.get("offset", "0"), "offset", tensor.name)
    length = _count(info["length"], "length", tensor.name) if "length" in info else nbytes
    if length != nbytes:
        raise InspectError(f"initializer {tensor.name!r}: external data length {length} but dims "
                           f"{list(tensor.dims)} of {type_name(tensor)} need {nbytes} bytes")
    if path not in files:
        what = f"initializer {tensor.name!r}: external data {info['location']!r}"
        stats, fd = paths.open_regular(path, root or folder, what)
        os.close(fd)
        files[path] = [stats, 0, set()]
    files[path][2].add(os.path.join(folder, info["location"]))  # the name onnxruntime will open, links and all
    size = files[path][0].st_size
    if offset + length > size:
        raise InspectError(f"initializer {tensor.name!r}: external data {info['location']!r} has {size} "
                           f"bytes, the tensor needs [{offset}, {offset + length})")
    files[path][1] += length
    return path, offset, length


def not_sparse(files):
    """Refuse a data file that declares far more tensor bytes than it holds on disk (holes read as zeros:
    a few KiB could otherwise make onnxruntime materialise gigabytes)."""
    for path, (info, declared, _) in files.items():
        held = info.st_blocks * 512
        declared = min(declared, info.st_size)  # tensors may share a range: the file holds what it is long
        if declared > wire.SPARSE_FROM and held < declared // 2:
            raise InspectError(f"external data {os.path.basename(path)!r} holds {held} bytes on disk but its tensors "
                               f"declare {declared}: a sparse file; refused")
