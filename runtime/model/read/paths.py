"""Where a model's files may lie, and files opened so that the file read is the file checked.

A name a client's layout, --files or a config gives is resolved once, against the folder as given, to one
relative name that stays inside it; every file is then opened by that name and its descriptor checked: the file
the kernel opened must really lie inside the folder's root. A link swapped in after the check is refused as a
change, never read. The one layout whose links leave the folder is Hugging Face's hub cache: a snapshot's files
(`models--ORG--NAME/snapshots/REV/...`) are links into the same repository's `blobs/`, so there the root is that
`models--*` folder."""
import os
import stat

from runtime.model.read.text import InspectError


def hub_root(folder):
    """The real path of the `models--ORG--NAME` repository folder when `folder` (really) lies in one of its
    snapshots (`.../models--ORG--NAME/snapshots/REV[/...]`), else None."""
    parts = os.path.realpath(folder).split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return os.sep.join(parts[:i]) or os.sep
    return None


def root_of(folder):
    """Where the files of `folder` may really lie: its real path, or a hub snapshot's repository folder."""
    return hub_root(folder) or os.path.realpath(folder)


def inside(path, root):
    """Whether the real path `path` is `root` or lies under it."""
    return os.path.commonpath([path, root]) == root


def relative(folder, name):
    """`name` (relative to `folder`, or absolute) as one normalized name relative to `folder`, or None when it leaves
    it. `..` is resolved by the name alone, before any link: `sub/../a.onnx` is `a.onnx`, whatever `sub` is, and
    the file then opened is folder/a.onnx (whose real path is checked when it is opened)."""
    if not name or "\x00" in name:
        return None
    for base in dict.fromkeys((os.path.abspath(folder), os.path.realpath(folder))):
        rel = os.path.relpath(os.path.normpath(os.path.join(base, name)), base)
        if rel != os.curdir and rel != os.pardir and not rel.startswith(os.pardir + os.sep):
            return rel
    return None


def opened(fd):
    """The real path of the file open on descriptor `fd` (as the kernel names it), or None when it cannot say (no
    /proc, or the file was removed since)."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return None if path.endswith(" (deleted)") or not os.path.isabs(path) else path


def check_opened(fd, path, root, what):
    """InspectError (closing `fd`) unless the file open on `fd` lies inside `root`: `path` was checked there, and a
    link retargeted or a file swapped in since is a change, not a file to read."""
    real = opened(fd)
    if real is None:
        real = os.path.realpath(path)  # no /proc: the closest the OS allows
    if not inside(real, root):
        os.close(fd)
        raise InspectError(f"{what}: not inside {root} when opened (a link retargeted or a file swapped in after it "
                           "was checked); nothing of it was read")


def open_regular(path, root, what):
    """(os.fstat, descriptor) of `path` opened for reading without blocking (a FIFO is refused, not waited on), a
    regular file inside `root`; else InspectError. A device is refused before it is opened (opening some does
    something), and the descriptor is checked again."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise InspectError(f"{what}: not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as e:
        raise InspectError(f"{what}: {getattr(e, 'strerror', None) or e}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a FIFO or device would block or never end
        os.close(fd)
        raise InspectError(f"{what}: not a regular file")
    if root is not None:
        check_opened(fd, path, root, what)
    return info, fd


def model_path(path):
    """(the path to read a model file by, the root it must lie in when opened, or None for anywhere). A file the
    user names is read at its real path (`link/..` as the OS resolves it), wherever that is; in a hub cache
    snapshot its folder is resolved and its own name kept, so that its data files and sidecars are found beside
    it in the snapshot, and what it links to must lie in the repository folder."""
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    hub = hub_root(folder)
    if hub is not None:
        return os.path.join(folder, os.path.basename(path)), hub
    return os.path.realpath(path), None
