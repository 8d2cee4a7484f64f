"""Several models saved as one folder with one external data file they share: each distinct tensor's bytes once,
so a table several files hold is stored once on disk and mapped once by the sessions that load them."""
import hashlib
import os
import shutil
import tempfile

import numpy as np
import onnx

from graphs.arrays import write_array
from graphs.storage import ALIGN, ALIGN_FROM, is_large, umask, without_large_tensors


def save_together(models, folder, data_name="model.data", min_external_bytes=1024):
    """Write `models` [(relative path, ModelProto, sources)] (sources as save() takes them) into a new folder
    `folder`, the tensors of `min_external_bytes` or more of the models in one directory in ONE data file
    `data_name` there that each of them names: each distinct tensor's bytes are written once (same type, dims and
    bytes, by digest) at an aligned offset, so a table several files hold is stored once and two sessions map the
    same pages. The folder is staged beside `folder` and renamed into place: it appears whole or not at all, and
    an existing one is refused. Every name must stay inside it (check_names): nothing is written anywhere else.
    Returns the paths written. The models passed in are not changed."""
    folder = os.path.abspath(os.fspath(folder))
    check_names([name for name, _, _ in models], data_name)
    if os.path.lexists(folder):
        raise FileExistsError(f"{folder} exists; refusing to overwrite it")
    staging = tempfile.mkdtemp(prefix=f".saving-{os.getpid()}-", dir=os.path.dirname(folder))  # see inspect.guard
    data_files, placed, written = {}, {}, []  # placed: (directory, type, dims, digest) -> (offset, length)
    try:
        for name, model, sources in models:
            sources = sources or {}
            where = os.path.dirname(name)
            os.makedirs(os.path.join(staging, where), exist_ok=True)
            if where not in data_files:
                data_files[where] = open(os.path.join(staging, where, data_name), "wb")
                written.append(os.path.join(folder, where, data_name))
            data = data_files[where]
            light = without_large_tensors(model, min_external_bytes)
            large = {t.name: t for t in model.graph.initializer if is_large(t, min_external_bytes)}
            for tensor in light.graph.initializer:
                if tensor.name not in large and tensor.name not in sources:
                    continue
                array = sources[tensor.name] if tensor.name in sources else \
                    np.frombuffer(large[tensor.name].raw_data, np.uint8)
                key = (where, tensor.data_type, tuple(tensor.dims), _digest(array))
                if key not in placed:
                    offset = data.tell() + (-data.tell() % (ALIGN if array.nbytes >= ALIGN_FROM else 16))
                    data.seek(offset)
                    write_array(data, array, tensor)
                    placed[key] = (offset, data.tell() - offset)
                tensor.ClearField("raw_data")
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.EXTERNAL
                for k, value in zip(("location", "offset", "length"), (data_name,) + tuple(map(str, placed[key]))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = k, value
            with open(os.path.join(staging, name), "wb") as f:
                f.write(light.SerializeToString())
            written.append(os.path.join(folder, name))
        for data in data_files.values():
            data.close()
        os.chmod(staging, 0o777 & ~umask())
        os.rename(staging, folder)  # atomic; refused if the folder appeared meanwhile and holds anything
    finally:
        for data in data_files.values():
            data.close()
        shutil.rmtree(staging, ignore_errors=True)
    return written


def check_names(names, data_name):
    """ValueError (one line) unless every name in `names` is a relative, normalized path inside the folder (no
    absolute name, no `..`, no `.` parts), each once, none the data file `data_name` of its directory or a folder
    another name needs: the staging folder's names are these, joined as given."""
    taken = set()
    for name in names:
        if not isinstance(name, str) or not name or os.path.isabs(name) or os.path.normpath(name) != name \
                or name.split(os.sep)[0] == os.pardir or "\x00" in name:
            raise ValueError(f"{name!r}: not a name inside the folder (absolute, or with '..' or '.' parts)")
        if os.path.basename(name) == data_name:
            raise ValueError(f"{name!r}: the name of the data file the models share; choose another data_name")
        if name in taken:
            raise ValueError(f"{name!r}: named twice")
        taken.add(name)
    for name in names:
        parent = os.path.dirname(name)
        while parent:
            if parent in taken:
                raise ValueError(f"{parent!r}: both a model file and the folder of {name!r}")
            parent = os.path.dirname(parent)


def _digest(array, chunk=16 * 2**20):
    """blake2b of an array's bytes in C order, read a block of leading-axis slices at a time."""
    h = hashlib.blake2b(digest_size=16)
    flat = array.reshape(1, -1) if array.ndim == 0 else array
    rows = max(1, chunk // max(1, flat[:1].nbytes))
    for start in range(0, len(flat), rows):
        h.update(np.ascontiguousarray(flat[start:start + rows]).data)
    return h.hexdigest()
