"""Several models saved as one folder with one external data file they share: each distinct tensor's bytes once,
so a table several files hold is stored once on disk and mapped once by the sessions that load them. Or, for
transformers.js, each model with data files of its own (`<file>_data`, chunked), the only form its browser build
reads."""
import hashlib
import os
import re
import shutil
import tempfile

import numpy as np
import onnx

from graphs.arrays import prefetch, release, write_array
from graphs.outputs import umask
from graphs.storage import ALIGN, ALIGN_FROM, is_large, without_large_tensors


def save_together(models, folder, data_name="model.data", min_external_bytes=1024, chunk_bytes=None, then=None):
    """Write `models` [(relative path, ModelProto, sources)] (sources as save() takes them) into a new folder
    `folder`, the tensors of `min_external_bytes` or more of the models in one directory in ONE data file
    `data_name` there that each of them names: each distinct tensor's bytes are written once (same type, dims and
    bytes, by digest) at an aligned offset, so a table several files hold is stored once and two sessions map the
    same pages. With `chunk_bytes`, transformers.js's layout instead: each model's tensors in data files of its own
    beside it, `<file>_data`, then `<file>_data_1`, `_2`, ... (chunk_names), a chunk ending before it would reach
    `chunk_bytes` (a tensor that alone reaches it has a chunk to itself); nothing shared across files, a tensor
    held twice in one file written once. `then(written)`: {relative name: bytes} to write beside the models once
    they are written (a config naming the chunks), `written` the paths so far relative to `folder`. The folder is
    staged beside `folder` and renamed into place: it appears whole or not at all, and an existing one is
    refused. Every name must stay inside it (check_names): nothing is written anywhere else. Returns the paths
    written. The models passed in are not changed."""
    staged = stage_together(models, folder, data_name, min_external_bytes, chunk_bytes, then)
    try:
        return staged.place()
    finally:
        staged.discard()


class StagedFolder:
    """A folder written whole in a staging folder beside its final name (stage_together): `staging` holds it, to be
    read and run first; `written` its paths, relative; place() renames it into place, discard() removes it (not
    what place() renamed)."""

    def __init__(self, staging, folder, written):
        self.staging, self.folder, self.written = staging, folder, written

    def path(self, name):
        """Where the file `name` (relative) lies while staged."""
        return os.path.join(self.staging, name)

    def place(self):
        """Rename the staging folder to its final name, refused (FileExistsError) if one appeared meanwhile and
        holds anything; returns the paths written there."""
        os.chmod(self.staging, 0o777 & ~umask())
        try:
            os.rename(self.staging, self.folder)  # atomic
        except OSError as e:
            if not os.path.lexists(self.folder):
                raise
            raise FileExistsError(f"{self.folder} appeared while writing; refusing to overwrite it") from e
        return [os.path.join(self.folder, name) for name in self.written]

    def discard(self):
        shutil.rmtree(self.staging, ignore_errors=True)


def stage_together(models, folder, data_name="model.data", min_external_bytes=1024, chunk_bytes=None, then=None):
    """save_together()'s first half, its arguments the same: the folder written in a new staging folder beside
    `folder` (`.saving-<pid>-*`, which runtime.inspect.sandbox.guard removes if the process dies); a StagedFolder.
    An existing `folder` is refused."""
    folder = os.path.abspath(os.fspath(folder))
    check_names([name for name, _, _ in models], data_name, per_file=chunk_bytes is not None)
    if os.path.lexists(folder):
        raise FileExistsError(f"{folder} exists; refusing to overwrite it")
    staging = tempfile.mkdtemp(prefix=f".saving-{os.getpid()}-", dir=os.path.dirname(folder))  # see inspect.guard
    targets, written = {}, []  # targets: where tensors go (a directory, or a model in per-file mode) -> _Data
    try:
        for name, model, sources in models:
            _write_model(staging, name, model, (sources or {}, min_external_bytes),
                         _target(targets, staging, name, data_name, chunk_bytes, written))
            written.append(name)
        for data in targets.values():
            data.close()
        for name, content in (then(list(written)) if then else {}).items():
            _write_beside(staging, name, content, data_name, written)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        for data in targets.values():
            data.close()
    return StagedFolder(staging, folder, written)


def _target(targets, staging, name, data_name, chunk_bytes, written):
    """The _Data the model `name`'s tensors go to: its own in per-file mode (`chunk_bytes`), else its directory's
    (opened even if no tensor goes there, as always)."""
    where = os.path.dirname(name)
    os.makedirs(os.path.join(staging, where), exist_ok=True)
    if chunk_bytes is not None:
        targets[name] = _Data(staging, name + "_data", chunk_bytes, written)
        return targets[name]
    if where not in targets:
        targets[where] = _Data(staging, os.path.join(where, data_name), None, written)
        targets[where].open()
    return targets[where]


def _write_model(staging, name, model, how, data):
    """The model file `name`, its large tensors placed in `data` (how: (sources, min_external_bytes))."""
    with open(os.path.join(staging, name), "wb") as f:
        f.write(_placed(model, how[0], data, how[1]).SerializeToString())


def _placed(model, sources, data, min_external_bytes):
    """A copy of `model` whose large tensors (and those `sources` gives) name where `data` (a _Data) placed them."""
    light = without_large_tensors(model, min_external_bytes)
    large = {t.name: t for t in model.graph.initializer if is_large(t, min_external_bytes)}
    for tensor in light.graph.initializer:
        if tensor.name not in large and tensor.name not in sources:
            continue
        array = sources[tensor.name] if tensor.name in sources else np.frombuffer(large[tensor.name].raw_data, np.uint8)
        location, offset, length = data.place(array, tensor)
        tensor.ClearField("raw_data")
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for k, value in zip(("location", "offset", "length"), (location, str(offset), str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = k, value
    return light


def _write_beside(staging, name, content, data_name, written):
    """A file save_together's `then` asked for, written into the staging folder (its name checked as a model's)."""
    check_names([name], data_name)
    if name in written:
        raise ValueError(f"{name!r}: both a model or data file and a file `then` writes")
    os.makedirs(os.path.join(staging, os.path.dirname(name)), exist_ok=True)
    with open(os.path.join(staging, name), "wb") as f:
        f.write(content)
    written.append(name)


class _Data:
    """The data file(s) of one directory (or one model): each distinct tensor placed once, at an aligned offset;
    with `chunk_bytes`, in chunks `<base>`, `<base>_1`, ... none reaching that size unless one tensor does."""

    def __init__(self, staging, base, chunk_bytes, written):
        self.staging, self.base, self.chunk_bytes, self.written = staging, base, chunk_bytes, written
        self.files, self.placed = [], {}  # placed: (type, dims, digest or sample) -> (location, offset, length)
        self.sampled = {}  # (type, dims, sample) -> the array first placed under it, None once digested whole

    def open(self):
        name = self.base if not self.files else f"{self.base}_{len(self.files)}"
        self.files.append(open(os.path.join(self.staging, name), "wb"))
        self.written.append(name)

    def place(self, array, tensor):
        key = self._key(array, tensor)
        if key not in self.placed:
            if not self.files:
                self.open()
            data = self.files[-1]
            offset = data.tell() + (-data.tell() % (ALIGN if array.nbytes >= ALIGN_FROM else 16))
            if self.chunk_bytes is not None and data.tell() and offset + array.nbytes >= self.chunk_bytes:
                self.open()  # this chunk would reach the limit: the tensor starts the next one
                data, offset = self.files[-1], 0
            data.seek(offset)
            write_array(data, array, tensor)
            self.placed[key] = (os.path.basename(data.name), offset, data.tell() - offset)
        return self.placed[key]

    def _key(self, array, tensor):
        """(type, dims, a digest of the bytes): the same key for the same tensor. Only a tensor whose type, dims
        and first and last bytes another's share is digested whole (and that other too): a model's many weights
        of one shape differ in their first bytes, and their digests would read every byte once more."""
        sample = (tensor.data_type, tuple(tensor.dims), _sampled(array))
        if sample not in self.sampled:
            self.sampled[sample] = array
            return sample
        first = self.sampled[sample]
        if first is not None:  # the first of its sample to be digested whole: placed under that key too
            whole = (tensor.data_type, tuple(tensor.dims), _digest(first))
            self.placed[whole] = self.placed[sample]
            self.sampled[sample] = None
        return tensor.data_type, tuple(tensor.dims), _digest(array)

    def close(self):
        for f in self.files:
            f.close()


def chunk_names(written, model):
    """The data files `save_together(..., chunk_bytes=...)` wrote for `model` (a path among `written`), in order:
    `<file>_data`, `<file>_data_1`, ... (transformers.js's names; its use_external_data_format counts them)."""
    pattern = re.compile(re.escape(model) + r"_data(_[1-9][0-9]*)?")
    found = [w for w in written if pattern.fullmatch(w)]
    return sorted(found, key=lambda w: int(w.rsplit("_", 1)[1]) if not w.endswith("_data") else 0)


def check_names(names, data_name, per_file=False):
    """ValueError (one line) unless every name in `names` is a relative, normalized path inside the folder (no
    absolute name, no `..`, no `.` parts), each once, none the data file `data_name` of its directory (or, with
    `per_file`, another's `<file>_data` chunk) or a folder another name needs: the staging folder's names are
    these, joined as given."""
    taken = set()
    for name in names:
        if not isinstance(name, str) or not name or os.path.isabs(name) or os.path.normpath(name) != name \
                or name.split(os.sep)[0] == os.pardir or "\x00" in name:
            raise ValueError(f"{name!r}: not a name inside the folder (absolute, or with '..' or '.' parts)")
        if os.path.basename(name) == data_name and not per_file:
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
        if per_file and any(re.fullmatch(re.escape(other) + r"_data(_[0-9]+)?", name) for other in taken):
            raise ValueError(f"{name!r}: the name of another model's data file")


def _sampled(array, count=4096):
    """A short key of an array's bytes in C order: its size, and blake2b of its first and last `count` bytes (for
    a view, only those elements are read)."""
    n = max(1, count // max(1, array.itemsize))
    flat = array.flat
    head, tail = flat[:min(n, array.size)], flat[max(0, array.size - n):array.size]
    h = hashlib.blake2b(digest_size=16)
    for part in (np.ascontiguousarray(head), np.ascontiguousarray(tail)):
        h.update(part.view(np.uint8).data)
    return f"{array.nbytes}:{h.hexdigest()}"


def _digest(array, chunk=16 * 2**20):
    """blake2b of an array's bytes in C order, read a block of leading-axis slices at a time."""
    h = hashlib.blake2b(digest_size=16)
    flat = array.reshape(1, -1) if array.ndim == 0 else array
    rows = max(1, chunk // max(1, flat[:1].nbytes))
    for start in range(0, len(flat), rows):
        block = flat[start:start + rows]
        prefetch(block)
        h.update(np.ascontiguousarray(block).data)
        if block.flags.c_contiguous:  # its own pages: let them go as it goes (graphs.arrays.release)
            release(block)
    return h.hexdigest()
