"""The checked-source contract: a model handed to onnxruntime only as it was checked, and Changed when a file is
not what was checked.

The parent reads a model file as a shell (runtime.model.read.wire: every byte but the raw data of its large inline
tensors, which it maps where they lie when it compares them) and records the file's identity (device, inode, size,
mtime) and the shell's digest. source() opens the file again, by the same name, and hands onnxruntime nothing
unless the file opened is that file (its identity) and says what was checked (its shell, read again from that
descriptor, has that digest), and every data file is still the file that was checked (device, inode, size).
onnxruntime then reads the file from that descriptor (/proc/self/fd/N: the file whose identity and shell were
compared, whatever its name leads to since), or the shell's bytes with the folder of its data. The raw data of an
inline tensor is read by onnxruntime where it lies, as an external data file's is: a rewrite of those bytes in place
that keeps the file's size and mtime is beyond what a check short of reading them again can see, as for data files.
The raw data is what a user's session holds in its memory; what the file says about it (names, types, dims,
offsets, the graph) is what the shell's digest covers."""
import contextlib
import io
import os

import onnx

from runtime.model.read import paths, wire
from runtime.model.read.model import all_tensors
from runtime.model.read.text import InspectError


class Changed(InspectError):
    """A file of the model is not what was checked: replaced, rewritten or resized since."""


class Source:
    """A checked model as source() found it: `shell` (a wire.Shell, its external data named in `folder`), `fd`
    (the model file, open), `data_files` (whether any tensor lies in a data file)."""

    def __init__(self, shell, folder, fd, data_files):
        self.shell, self.folder, self.fd, self.data_files = shell, folder, fd, data_files

    def as_user(self):
        """(what onnxruntime opens, the folder of its data or None) for a session that costs what a user's does: the
        file itself (by its descriptor) where it holds every tensor, else the shell's bytes, which hold every byte
        of the file where it left none in it (a model whose large tensors are external data)."""
        own = f"/proc/self/fd/{self.fd}"
        if self.shell.lazy and not self.data_files and os.path.exists(own):
            return own, None
        return self.shell.data, self.folder

    def as_shell(self):
        """(the shell's bytes, the folder of its data): onnxruntime maps or reads each large tensor from where it
        lies, the model file's own too, and holds no protobuf of them (runtime.optimized.layout_session)."""
        return self.shell.data, self.folder

    def close(self):
        os.close(self.fd)


def source(checked):
    """The Source of the model described by `checked` (a Model's) if the file opened now is the file that was
    checked, its shell the shell checked, and every data file still the file that was checked (device, inode,
    size); else Changed. (A data file onnxruntime opens itself is compared by identity just before: the closest the
    OS allows.)"""
    path = checked["path"]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in: no wait
    except OSError as e:
        raise Changed(f"{path}: {e.strerror} (after it was checked)") from None
    try:
        shell = _same_file(fd, checked)
    except BaseException:
        with contextlib.suppress(OSError):  # (paths.check_opened closes it itself)
            os.close(fd)
        raise
    for name, identity in checked["files"].items():  # each by the name onnxruntime opens: a link retargeted shows
        try:
            info = os.stat(name)
            now = [info.st_dev, info.st_ino, info.st_size]
        except OSError as e:
            raise Changed(f"{name}: {e.strerror} (after it was checked)") from None
        if now != identity:
            raise Changed(f"{name} changed after it was checked (now {now[2]} bytes, then {identity[2]}); nothing "
                          "of the model was run")
    data, folder = shell.data, checked["folder"]
    if checked.get("root") is not None and paths.hub_root(checked["folder"]) is not None:
        data, folder = in_blobs(data, folder)
    renamed = wire.Shell(data, shell.lazy, shell.size)
    renamed.identity = shell.identity
    return Source(renamed, folder, fd, bool(checked["files"]))


def _same_file(fd, checked):
    """The shell of the file open on `fd`, if it is the file `checked` describes; else Changed."""
    path = checked["path"]
    if checked.get("root") is not None:
        try:
            paths.check_opened(fd, path, checked["root"], path)
        except InspectError as e:
            raise Changed(str(e)) from None
    info = os.fstat(fd)
    changed = Changed(f"{path} changed after it was checked; nothing of it was run")
    if [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns] != checked["identity"]:
        raise changed  # another file, or this one written since (a FIFO or device is another file: never read)
    try:
        shell = wire.read(io.FileIO(fd, closefd=False), info.st_size, os.path.basename(path))
    except InspectError:
        raise changed from None
    if shell.digest != checked["digest"]:
        raise changed
    shell.identity = checked["identity"]
    return shell


def in_blobs(data, folder):
    """(bytes, folder) for onnxruntime of a model in a hub cache snapshot `folder`: each external-data location
    renamed to the blob its link leads to, and the blobs' folder. onnxruntime refuses a data file whose real path
    leaves the folder it is told (a snapshot's files are links into blobs/); named by their blobs, they lie in it.
    As they are where the data lie in more than one folder, or none is external."""
    proto = onnx.ModelProto()
    proto.ParseFromString(data)
    folders = set()
    for tensor, _ in all_tensors(proto.graph, proto.functions):
        for entry in tensor.external_data if tensor.data_location == onnx.TensorProto.EXTERNAL else ():
            if entry.key == "location":
                real = os.path.realpath(os.path.join(folder, entry.value))
                folders.add(os.path.dirname(real))
                entry.value = os.path.basename(real)
    if len(folders) != 1:
        return data, folder
    return proto.SerializeToString(), folders.pop()
