"""The checked-source contract: a model's bytes handed to onnxruntime only as they were checked, and
Changed when a file is not what was checked."""
import hashlib
import os
import stat

from runtime.inspect.read.text import InspectError


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
    return data, checked["folder"]
