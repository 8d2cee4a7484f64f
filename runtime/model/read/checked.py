"""The checked-source contract: a model's bytes handed to onnxruntime only as they were checked, and
Changed when a file is not what was checked."""
import hashlib
import os
import stat

import onnx

from runtime.model.read import paths
from runtime.model.read.model import all_tensors
from runtime.model.read.text import InspectError


class Changed(InspectError):
    """A file of the model is not what was checked: replaced, rewritten or resized since."""


def source(checked):
    """(bytes, folder) of the model described by `checked` (a Model's): the model file's bytes, as read now, if
    they are the bytes that were checked and every data file is still the file that was checked (device, inode,
    size); else Changed. Give onnxruntime these bytes, not the path: a file swapped in after the check is never
    parsed. (A data file onnxruntime opens itself is compared by identity just before: the closest the OS allows.)"""
    try:
        fd = os.open(checked["path"], os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in: no wait
    except OSError as e:
        raise Changed(f"{checked['path']}: {e.strerror} (after it was checked)") from None
    if checked.get("root") is not None:
        try:
            paths.check_opened(fd, checked["path"], checked["root"], checked["path"])
        except InspectError as e:
            raise Changed(str(e)) from None
    with open(fd, "rb") as f:
        data = f.read(checked["size"] + 1) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    if hashlib.blake2b(data, digest_size=16).hexdigest() != checked["digest"]:
        raise Changed(f"{checked['path']} changed after it was checked; nothing of it was run")
    for path, identity in checked["files"].items():  # each by the name onnxruntime opens: a link retargeted shows
        try:
            info = os.stat(path)
            now = [info.st_dev, info.st_ino, info.st_size]
        except OSError as e:
            raise Changed(f"{path}: {e.strerror} (after it was checked)") from None
        if now != identity:
            raise Changed(f"{path} changed after it was checked (now {now[2]} bytes, then {identity[2]}); nothing "
                          "of the model was run")
    if checked.get("root") is not None and paths.hub_root(checked["folder"]) is not None:
        return in_blobs(data, checked["folder"])
    return data, checked["folder"]


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
