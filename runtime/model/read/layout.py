"""The files a client loads together from a folder: genai_config.json's, Optimum's encoder and merged
decoder (or the split pair), transformers.js's onnx/ layout at one dtype suffix (a decoder-only model's
onnx/model.onnx, or its first variant), else every .onnx file."""
import json
import os

from runtime.model.read import paths, sidecars
from runtime.model.read.text import InspectError

SUFFIXES = ("", "_fp16", "_q4", "_q4f16", "_int8", "_uint8", "_quantized", "_bnb4")  # transformers.js dtypes

_ENCODERS = ("embed_tokens", "vision_encoder", "audio_encoder", "encoder_model")


def client_files(folder, chosen=None):
    """(the .onnx files a client loads together, relative to `folder`, the rule that chose them). `chosen`: the
    names --files gave. Each name is resolved once (read.paths.relative: absolute names and `..` made relative,
    one file named twice kept once) and must really lie inside the folder (or, in a hub cache snapshot, its
    repository); the names returned are those checked, and the only ones opened. InspectError when the folder holds
    none, or a name leaves it."""
    named, rule = _chosen_by_layout(folder, chosen)
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
    genai = sidecars.genai_config(os.path.join(folder, sidecars.GENAI_CONFIG)) or {}
    section = genai.get("model") if isinstance(genai.get("model"), dict) else {}
    named = [part.get("filename") for part in section.values() if isinstance(part, dict)]
    named = [n for n in named if isinstance(n, str) and n and "\x00" not in n
             and os.path.lexists(os.path.join(folder, n))]
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
