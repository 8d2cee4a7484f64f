"""The files a client loads together from a folder: genai_config.json's, Optimum's encoder and merged
decoder (or the split pair), transformers.js's onnx/ layout at one dtype suffix (a decoder-only model's
onnx/model.onnx, or its first variant), else every .onnx file. A transformers.js folder is one client load per dtype
variant (variants): transformers.js opens one dtype's files."""
import json
import os

from runtime.model.read import paths, sidecars
from runtime.model.read.text import InspectError

# transformers.js 4.3.2's DEFAULT_DTYPE_SUFFIX_MAPPING (src/utils/dtypes.js), in its order: the files of dtype D
# are onnx/<session><DTYPES[D]>.onnx (q8's are model_quantized.onnx)
DTYPES = {"fp32": "", "fp16": "_fp16", "int8": "_int8", "uint8": "_uint8", "q8": "_quantized", "q4": "_q4",
          "q2": "_q2", "q1": "_q1", "q4f16": "_q4f16", "q2f16": "_q2f16", "q1f16": "_q1f16", "bnb4": "_bnb4"}
SUFFIXES = tuple(DTYPES.values())

_ENCODERS = ("embed_tokens", "vision_encoder", "audio_encoder", "encoder_model")


def client_files(folder, chosen=None, dtype=None):
    """(the .onnx files a client loads together, relative to `folder`, the rule that chose them). `chosen`: the
    names --files gave; `dtype`: --dtype's, the variant of a transformers.js folder (variant_files). Each name is
    resolved once (read.paths.relative: absolute names and `..` made relative, one file named twice kept once) and
    must really lie inside the folder (or, in a hub cache snapshot, its repository); the names returned are those
    checked, and the only ones opened. InspectError when the folder holds none, or a name leaves it."""
    named, rule = _chosen_by_layout(folder, chosen) if dtype is None else variant_files(folder, dtype)
    root, files = paths.root_of(folder), []
    for name in named:  # a link or a `..` out of the folder is not one of its files, whoever names it
        what = f"{'--files ' if chosen else ''}{name}"
        rel = paths.relative(folder, name)
        if rel is None or not paths.inside(os.path.realpath(os.path.join(folder, rel)), root):
            raise InspectError(f"{what}: not inside {folder} (a link or a path out of it, named by {rule})")
        path = os.path.join(folder, rel)
        if not os.path.exists(path):  # absent, or a link to nothing
            raise InspectError(f"{what}: no such file in {folder}")
        if not os.path.isfile(path):
            raise InspectError(f"{what}: not a regular file (named by {rule})")
        if rel not in files:
            files.append(rel)
    return files, rule


def _chosen_by_layout(folder, chosen):
    """client_files' choice before its names are checked."""
    if chosen:
        return list(dict.fromkeys(chosen)), "--files"
    named = _genai(folder)
    if named:
        return list(dict.fromkeys(named)), "genai_config.json's model files"
    if os.path.isdir(os.path.join(folder, "onnx")):
        found = _layout(folder, "onnx")
        if found:
            files, suffix = found
            return files, f"transformers.js's onnx/ layout at dtype suffix {suffix!r} (embed_tokens, encoders, decoder)"
        variants = [f"model{suffix}.onnx" for suffix in SUFFIXES]
        variant = next((v for v in variants if os.path.isfile(os.path.join(folder, "onnx", v))), None)
        if variant:  # a decoder-only model: one file per dtype, and a client loads one of them
            return [os.path.join("onnx", variant)], (f"transformers.js's onnx/ layout: one dtype variant, "
                                                     f"{variant} (a client loads one)")
    found = _layout(folder, "", suffixes=("",))
    if found:
        files = found[0]
        merged = any(f.endswith("decoder_model_merged.onnx") for f in files)
        return files, ("Optimum's: the encoder and the merged decoder, as ORTModelForSeq2SeqLM opens them" if merged
                       and any("encoder" in f for f in files) else "Optimum's merged decoder" if merged else
                       "Optimum's split decoder pair (no merged file)")
    every = sorted(n for n in os.listdir(folder) if n.endswith(".onnx") and os.path.isfile(os.path.join(folder, n)))
    if not every:
        raise InspectError(f"{folder}: no .onnx file in the folder (and no genai_config.json naming one)")
    return every, "every .onnx file in the folder"


def _genai(folder):
    """The model files genai_config.json in `folder` names that exist (as links or files), or []."""
    genai = sidecars.genai_config(os.path.join(folder, sidecars.GENAI_CONFIG)) or {}
    section = genai.get("model") if isinstance(genai.get("model"), dict) else {}
    named = [part.get("filename") for part in section.values() if isinstance(part, dict)]
    return [n for n in named if isinstance(n, str) and n and "\x00" not in n
            and os.path.lexists(os.path.join(folder, n))]


def _layout(folder, sub, suffixes=SUFFIXES):
    """([files], suffix) of an Optimum / transformers.js layout in folder/sub at the first dtype suffix it has."""
    where = os.path.join(folder, sub)
    for suffix in suffixes:
        exists = lambda stem: os.path.isfile(os.path.join(where, stem + suffix + ".onnx"))
        if exists("decoder_model_merged"):
            decoders = ["decoder_model_merged"]
        elif exists("decoder_model"):
            decoders = ["decoder_model"] + (["decoder_with_past_model"] if exists("decoder_with_past_model") else [])
        else:
            continue
        stems = [s for s in _ENCODERS if exists(s)] + decoders
        return [os.path.join(sub, s + suffix + ".onnx") for s in stems], suffix
    return None


def transformersjs_root(folder):
    """(its root, the folder its model files lie in relative to that root) when `folder` is a transformers.js
    folder: a root whose config.json (a JSON object) lies beside onnx/, gives (folder, ""); onnx/ itself, the
    same beside its parent, gives (parent, "onnx"). None for any other folder. The config is read as sidecars
    read it (a regular file in that folder, not a link out of it, and small)."""
    folder = os.path.abspath(folder)
    if os.path.isdir(os.path.join(folder, "onnx")) and _config(folder):
        return folder, ""
    if os.path.basename(folder) == "onnx" and _config(os.path.dirname(folder)):
        return os.path.dirname(folder), "onnx"
    return None


def _config(folder):
    data = sidecars.read(os.path.join(folder, "config.json"), "config.json")
    try:
        return isinstance(json.loads(data), dict) if data is not None else False
    except (ValueError, RecursionError):
        return False


def dtype_of(name):
    """The transformers.js dtype of a model file's name: its suffix's (`decoder_model_merged_q4f16.onnx`: q4f16), or
    fp32 where it has none."""
    stem = name[:-len(".onnx")] if name.endswith(".onnx") else name
    return next((dtype for dtype, suffix in DTYPES.items() if suffix and stem.endswith(suffix)), "fp32")


def variants(folder):
    """[(dtype, [its files, relative to `folder`])] of a transformers.js folder (transformersjs_root: its root or its
    onnx/), one per dtype it holds files of, in DTYPES' order; None for any other folder (and for one whose
    genai_config.json names its files). A variant's files are those of one suffix that a client opens together:
    embed_tokens, encoders and the decoder (the merged one where there is one), else model<suffix>.onnx, else every
    file of that suffix."""
    found = transformersjs_root(folder)
    if found is None or _genai(folder):
        return None
    sub = "" if found[1] else "onnx"  # where the files lie, relative to `folder`
    where = os.path.join(folder, sub)
    listed = sorted(n for n in os.listdir(where) if n.endswith(".onnx") and os.path.isfile(os.path.join(where, n)))
    chosen = []
    for dtype, suffix in DTYPES.items():
        layout = _layout(folder, sub, suffixes=(suffix,))
        single = f"model{suffix}.onnx"
        files = (layout[0] if layout else [os.path.join(sub, single)] if single in listed else
                 [os.path.join(sub, n) for n in listed if dtype_of(n) == dtype])
        if files:
            chosen.append((dtype, files))
    return chosen or None


def variant_files(folder, dtype):
    """(the files of variant `dtype` of the transformers.js folder `folder`, the rule); InspectError, naming the
    dtypes the folder has, for a name transformers.js does not know, a variant the folder lacks, or a folder that is
    not a transformers.js folder."""
    found = variants(folder)
    if found is None:
        raise InspectError(f"--dtype {dtype}: {folder} is not a transformers.js folder (config.json beside onnx/ "
                           "holding model files), so it has no dtype variants; --dtype chooses one of them")
    have = ", ".join(d for d, _ in found)
    if dtype not in DTYPES:
        raise InspectError(f"--dtype {dtype}: not a transformers.js dtype (one of {', '.join(DTYPES)}); {folder} "
                           f"has {have}")
    files = dict(found).get(dtype)
    if files is None:
        named = f"named *{DTYPES[dtype]}.onnx" if DTYPES[dtype] else "without a dtype suffix"
        raise InspectError(f"--dtype {dtype}: {folder} has no {dtype} variant (no model file {named}); it has {have}")
    return files, f"the files transformers.js opens with dtype '{dtype}', suffix {DTYPES[dtype]!r}"


def sidecar_folders(folder):
    """Where the files beside a model in `folder` are read: its own folder, and for a transformers.js folder's onnx/
    the root above it (transformersjs_root); no other parent, which the user did not name."""
    found = transformersjs_root(folder)
    return [folder] + ([found[0]] if found and found[1] else [])


def tokenizer_of(model_path):
    """The model's tokenizer.json as the tokenizers library makes it (read where sidecar_folders says, by
    sidecars.read), with no padding or truncation: a text is tokenized whole. None where there is none, or the
    library is not installed or refuses the file."""
    try:
        import tokenizers
    except ImportError:
        return None
    for where in sidecar_folders(os.path.dirname(os.path.abspath(model_path))):
        raw = sidecars.read(os.path.join(where, "model.onnx"), "tokenizer.json", sidecars.TOKENIZER_MOST)
        if raw is None:
            continue
        try:
            made = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception:  # noqa: BLE001 - the library's own parse error, whatever its type
            return None
        made.no_padding()
        made.no_truncation()
        return made
    return None
