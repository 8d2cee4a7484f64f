"""The token table of a real model, decoded to float32 exactly as its lookup reads it.

ONNX models (a file, a folder, a hub cache snapshot) are read through runtime.model, the checked reader and table
finder inspect uses; a GGUF file through the optional gguf package. Float16 and bfloat16 values widen exactly;
int8 / int4 codes become (code - zero point) x scale, rounded once to the type the lookup's scale has (float32,
or float16 for a q4f16 model, then widened)."""
import os

import numpy as np
from onnx import TensorProto

from runtime.model.findings.across import relate_files
from runtime.model.found import static_findings
from runtime.model.graph import quantized
from runtime.model.read import paths
from runtime.model.read.layout import client_files, variants
from runtime.model.read.model import FLOATS, load
from runtime.model.read.text import InspectError
from runtime.compare.real.table import Table
from runtime.compare.real.tokens import vocabulary_size

_ROWS_AT_ONCE = 2**22  # values decoded a block of rows at a time


def read_table(path, name=None):
    """find_table's Table, its values decoded."""
    table = find_table(path, name)
    table.read()
    return table


def find_table(path, name=None):
    """The Table of the model at `path` (an ONNX file or folder, or a GGUF file), its values not yet decoded; `name`
    picks a token table where the model has several (else the one whose rows match the vocabulary's size).
    InspectError (one line) for anything that is not a readable model with a token table."""
    if not os.path.lexists(path):
        raise InspectError(f"{path}: no such file or folder")
    if os.path.isfile(path) and _is_gguf(path):
        from runtime.compare.real.gguf_table import gguf_table  # the optional gguf package, imported only here
        return gguf_table(path, name)
    return _onnx_table(path, name)


def _is_gguf(path):
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise InspectError(f"{path}: {e.strerror}") from None


def _files(path):
    """([file paths], root each must lie in, the folder the tokenizer lies in or above). Of a transformers.js
    folder (its root or its onnx/), the fp32 variant where it has one, else its first (layout.variants): a client
    loads one variant, and the others hold the same table in other formats."""
    if os.path.isdir(path):
        folder = os.path.abspath(path)
        found = dict(variants(folder) or {})
        chosen = found.get("fp32") or next(iter(found.values()), None)
        if not found and os.path.isfile(os.path.join(folder, "model.onnx")) and any(
                n.startswith("model_") and n.endswith(".onnx") for n in os.listdir(folder)):
            chosen = ["model.onnx"]  # onnx/ with no config.json above it: its fp32 variant, as above
        names, _ = client_files(folder, chosen)  # else genai's, Optimum's, ... or every file
        return [os.path.join(folder, n) for n in names], paths.root_of(folder), folder
    if not os.path.isfile(path):
        raise InspectError(f"{path}: not a regular file or folder")
    file, root = paths.model_path(path)
    return [file], root, os.path.dirname(file)


def _onnx_table(path, name):
    files, root, folder = _files(path)
    items = []
    for file in files:
        model = load(file, root=root)
        items.append({"file": os.path.relpath(file, folder), "model": model, "info": static_findings(model)})
    found = [e for it in items for e in it["info"].tables + it["info"].heads]
    scales = {e.quant.scale for e in found if e.quant} | {e.scales for e in found}
    groups = [g for g in relate_files(items)["vocabulary"] if g["kind"] == "token" and g["table"] not in scales]
    names = list(dict.fromkeys(g["table"] for g in groups))
    if not groups:
        raise InspectError(f"{path}: no token table: nothing looks rows up by token id (a Gather, "
                           "GatherBlockQuantized or OneHot product on ids)")
    if name is None and len(names) > 1:
        name = _of_vocabulary(path, folder, groups, names)
    group = next((g for g in groups if name in (None, g["table"])), None)
    if group is None:
        raise InspectError(f"--table {name}: not a token table of {path} (its token tables: {', '.join(names)})")
    lookup = next(m for m in group["members"] if m.role == "lookup")
    item, entry = lookup.item, lookup.entry
    quant = entry.quant or next((m.entry.quant for m in group["members"]  # a head decoding the same codes
                                 if m.entry.initializer == entry.initializer and m.entry.quant), None)
    vocabulary = next(v for v in item["info"].vocabulary if v["table"] == entry.initializer)
    heads = [m.entry.initializer for m in group["members"] if m.role == "head"]
    head = heads[0] if heads else (entry.initializer if group["tied"] else None)
    scored = group["tied"] or any(h.vocab == entry.vocab for it in items for h in it["info"].heads)
    model = item["model"]
    return Table(model=model.path, name=entry.initializer, shape=(entry.vocab, entry.width),
                 format=entry.format, bytes=entry.bytes, tied=group["tied"], head=head,
                 row_scale=vocabulary["row_scale"], row_scale_is_sqrt_width=vocabulary["row_scale_is_sqrt_width"],
                 folder=folder, scored=scored, others=[n for n in names if n != entry.initializer],
                 reader=lambda: decode(model, entry, quant))


def _of_vocabulary(path, folder, groups, names):
    """Of several token tables, the one whose rows match the vocabulary's size (tokenizer.json's, or config.json's
    vocab_size): a BERT's word table beside its position and token-type tables; InspectError where none or several
    do."""
    size = vocabulary_size(folder)
    matching = [g["table"] for g in groups if g["vocab_size"] == size]
    if size is not None and len(set(matching)) == 1:
        return matching[0]
    said = f"none has the vocabulary's {size} rows" if size is not None else "no tokenizer.json or config.json says " \
        "the vocabulary's size"
    raise InspectError(f"{path}: {len(names)} token tables ({', '.join(names)}) and {said}; pick one with --table")


def decode(model, entry, q=None):
    """The table `entry` (graph.walk's) of `model` as float32 [vocab, width]: the stored float32 array itself when
    it is stored [vocab, width] (memory-mapped where external, never copied), else decoded a block of rows at a
    time; `q` how its codes decode (a graph.quantized.Quant: the entry's own, or the head's reading the same
    codes)."""
    tensor = model.tensors[entry.initializer]
    q = q or entry.quant
    if q is None and tensor.data_type not in FLOATS:
        raise InspectError(f"{entry.initializer}: a {tensor.type_name} table that nothing decodes "
                           "(compare --model reads float tables and int8 / int4 codes with their scales)")
    vocab, width = entry.vocab, entry.width
    if q is None:
        values = tensor.values() if entry.rows_are_tokens else tensor.values().T
        if values.dtype == np.float32 and values.flags.c_contiguous:
            return values
    out = np.empty((vocab, width), np.float32)
    step = max(1, _ROWS_AT_ONCE // width)
    for t0 in range(0, vocab, step):
        t1 = min(vocab, t0 + step)
        out[t0:t1] = values[t0:t1] if q is None else _dequantized(model, q, t0, t1)
    return out


def _dequantized(model, q, t0, t1):
    """Rows t0..t1 of a quantized table as its lookup gives them: (code - zero point) x scale, an exact float64
    product rounded once to the scale's type (what DequantizeLinear and GatherBlockQuantized output), widened."""
    decoded = quantized.decoded(model, q, t0, t1)
    if decoded is None:
        raise InspectError(f"{q.codes}: its scales are not initializers, or its codes lie in typed fields; "
                           "compare --model cannot decode it")
    scale_type = model.tensors[q.scale].data_type
    if scale_type == TensorProto.FLOAT16:
        return decoded[0].astype(np.float16)
    if scale_type == TensorProto.BFLOAT16:
        import ml_dtypes  # onnx's own dependency
        return decoded[0].astype(ml_dtypes.bfloat16).astype(np.float32)
    return decoded[0].astype(np.float32)
