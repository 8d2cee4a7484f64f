"""The files a model's runtime reads beside it (onnxruntime-genai's genai_config.json, Hugging Face's config and
tokenizer files): read only when regular, inside the model's folder and small; copied beside a retied OUT so it
is a drop-in model, never over a file that is there."""
import json
import os
import stat
import tempfile

from graphs.outputs import umask
from runtime.model.read import paths
from runtime.model.read.text import InspectError

MAX_BYTES = 16 * 2**20  # a config or tokenizer file larger than this is not one
TOKENIZER_MOST = 64 * 2**20  # a tokenizer.json past this is not one (Gemma's is 34 MB)

GENAI_CONFIG = "genai_config.json"

NAMES = (GENAI_CONFIG, "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
         "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json",
         "preprocessor_config.json", "processor_config.json")


def read(model_path, name, most=MAX_BYTES):
    """The bytes of sidecar `name` beside the model, or None (absent, not a regular file, a link out of the
    folder, larger than `most` bytes). Opened without following a final link (in a hub cache snapshot, where every
    file is a link into the repository's blobs/, following it only there), checked on the descriptor."""
    folder = os.path.dirname(os.path.abspath(model_path))
    path = os.path.join(folder, name)
    hub = paths.hub_root(folder)
    if hub is None:  # a link to a file of the same folder is read as that file; one out of it is not read
        path = os.path.realpath(path)
        if os.path.dirname(path) != os.path.realpath(folder):
            return None
    try:
        if not stat.S_ISREG((os.stat if hub else os.lstat)(path).st_mode):  # a device is not opened at all
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if hub else os.O_NOFOLLOW))  # a FIFO swapped in: no wait
        if hub is not None:
            paths.check_opened(fd, path, hub, name)
    except (OSError, InspectError):
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > most:  # swapped in since the lstat, or too large
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(most + 1)[:most]


def genai_config(model_path):
    """onnxruntime-genai's genai_config.json beside the model as a dict, or None."""
    data = read(model_path, GENAI_CONFIG)
    try:
        config = json.loads(data) if data is not None else None
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    return config if isinstance(config, dict) else None


MOST = 1 << 16  # a count read from a config or an option (window, context, head size, past) must stay below this


def genai_head_size(model_path):
    """head_size from genai_config.json beside the model, if there is one that says."""
    try:
        size = genai_config(model_path)["model"]["decoder"]["head_size"]
    except (TypeError, KeyError):
        return None
    return size if isinstance(size, int) and 0 < size < MOST else None


def copy_beside(model_path, out_path):
    """Copy each sidecar beside the model to OUT's folder (genai_config.json naming OUT's file as its decoder);
    one line per file, copied or why not. Nothing is copied when OUT lies in the model's own folder."""
    source, target = os.path.dirname(os.path.abspath(model_path)), os.path.dirname(os.path.abspath(out_path))
    if os.path.realpath(source) == os.path.realpath(target):
        present = [n for n in NAMES if read(model_path, n) is not None]
        if GENAI_CONFIG in present and decoder_file(genai_config(model_path)) != os.path.basename(out_path):
            return [f"{GENAI_CONFIG} names {decoder_file(genai_config(model_path))!r}, not OUT: it is not changed; "
                    "put OUT in a folder of its own for onnxruntime-genai to load it"]
        return []
    lines = []
    for name in NAMES:
        data = read(model_path, name)
        if data is None:
            continue
        if name == GENAI_CONFIG:
            config = genai_config(model_path)
            if config is not None and decoder_file(config) is not None:
                config["model"]["decoder"]["filename"] = os.path.basename(out_path)
                try:
                    data = (json.dumps(config, indent=4) + "\n").encode()
                except RecursionError:  # nested deeper than the writer goes: not a config to rewrite
                    lines.append(f"{name} not copied beside OUT: nested too deep to rewrite")
                    continue
        lines.append(_claim(os.path.join(target, name), data))
    return lines


def copy_into(folder, out, where=("",), skip=()):
    """Copy the sidecars of `folder`'s top and of each of its subfolders `where` (those the client's files lie in)
    to the same places in the new folder `out`, whose model files keep their names; genai_config.json is written
    with each model file it names as the name that resolves to inside the folder (read.paths.relative: a
    `../FOLDER/model.onnx` becomes `model.onnx`), so that OUT's config names OUT's files; the names in `skip`
    (OUT's own config.json, written with it) are not copied. One line per file."""
    lines = []
    for sub in dict.fromkeys(("",) + tuple(where)):
        source = os.path.join(folder, sub, "model.onnx")  # read() takes a model's path: the sidecars beside it
        for name in NAMES:
            data = read(source, name) if os.path.join(sub, name) not in skip else None
            if data is None:
                continue
            label = os.path.join(sub, name)
            if name == GENAI_CONFIG:
                data = _renamed(genai_config(source), os.path.join(folder, sub))
                if data is None:
                    lines.append(f"{label} not copied into OUT: not a JSON object, or nested too deep to rewrite")
                    continue
            lines.append(_claim(os.path.join(out, label), data, label, "into OUT"))
    return lines


def _renamed(config, folder):
    """genai_config.json's bytes with each model file named as paths.relative resolves it, or None."""
    if config is None:
        return None
    section = config.get("model") if isinstance(config.get("model"), dict) else {}
    for part in section.values():
        name = part.get("filename") if isinstance(part, dict) else None
        rel = paths.relative(folder, name) if isinstance(name, str) else None
        if rel is not None:
            part["filename"] = rel
    try:
        return (json.dumps(config, indent=4) + "\n").encode()
    except RecursionError:
        return None


def decoder_file(config):
    """The decoder file genai_config.json (as a dict) names, or None."""
    try:
        name = config["model"]["decoder"]["filename"]
    except (TypeError, KeyError):
        return None
    return name if isinstance(name, str) else None


def _claim(path, data, shown=None, place="beside OUT"):
    """Write `data` to a staging file, then link it to `path` only if nothing is there (never replaced). A file
    that cannot be written (a full disk) is said in the line and skipped: OUT, already in place, stays whole.
    The line names it `shown` (default: its name) `place`."""
    name = shown or os.path.basename(path)
    try:
        fd, staged = tempfile.mkstemp(prefix=f".sidecar-{os.getpid()}-", dir=os.path.dirname(path))  # see guard
    except OSError as e:
        return f"{name} not copied {place}: {e.strerror}"
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(staged, 0o666 & ~umask())
        os.link(staged, path)
    except FileExistsError:
        return f"{name} exists {place}: left as it is"
    except OSError as e:
        return f"{name} not copied {place}: {e.strerror}"
    finally:
        os.unlink(staged)
    return f"copied {name} {place}"
