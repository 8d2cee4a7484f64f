"""The files a command is told to write, checked before any work (a path that is UTF-8, in a folder that exists
and may be written) and written atomically with the user's usual mode."""
import json
import os
import sys
import tempfile


def umask():
    """This process's umask (read by setting it and putting it back): the mode bits a new file should lose."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_output(path, what):
    """ValueError (one line) unless `path` names a file this process can create: not a folder, in a folder that
    exists and it may write. Checked before the work, so an hour of measuring never ends in a bad path."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path or path.endswith(os.sep) or os.path.isdir(path):
        raise ValueError(f"{what} {path!r}: a folder or nothing; name the file to write")
    check_utf8(path, what)
    if not os.path.isdir(folder):
        raise ValueError(f"{what} {path}: no such folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: the folder {folder} is not writable")


def check_utf8(path, what):
    """ValueError (one line) unless `path` is UTF-8: onnx names data files by it, onnxruntime takes folders as it."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} {path!r} is not UTF-8: onnx takes only UTF-8 paths") from None


def check_folder(folder, what):
    """ValueError (one line) unless `folder` is, or can be made as, a folder this process may write into."""
    if not folder or (os.path.exists(folder) and not os.path.isdir(folder)):
        raise ValueError(f"{what} {folder!r} is not a folder")
    check_utf8(folder, what)
    existing = folder
    while not os.path.isdir(existing):  # the folder a missing one would be made in
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {folder}: {existing} is not writable")


def write_text(path, text):
    """Write `text` to `path` atomically (a staged file in the same folder, then renamed into place, replacing
    what was there) with the user's usual mode; nothing is left behind if writing fails."""
    fd, staged = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".writing-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(staged, 0o666 & ~umask())  # mkstemp makes it 0600
        os.replace(staged, path)
    except BaseException:
        os.unlink(staged)
        raise


def write_json(path, data):
    """`data` as indented JSON: to stdout where `path` is "-", else written to `path` atomically (write_text)."""
    text = json.dumps(data, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        write_text(path, text)
