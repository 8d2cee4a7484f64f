"""A GGUF file's token table (`token_embd.weight`) and vocabulary, through the optional gguf package: most models
people hold locally are GGUF. llama.cpp scores with the token table itself when the file has no `output.weight`."""
import os

import numpy as np

from runtime.model.read.text import InspectError
from runtime.compare.real.gguf_header import read_header
from runtime.compare.real.table import Table

_TOKEN_TABLE, _HEAD = "token_embd.weight", "output.weight"


_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.model", "tokenizer.ggml.scores",
         "general.architecture")


def gguf_table(path, name=None):
    """runtime.compare.real.table.Table of the GGUF file at `path`, its header read by gguf_header, its values
    decoded by the gguf package (to float32) when the Table is read."""
    try:
        import gguf
    except ImportError:
        raise InspectError(f"{path}: a GGUF file; reading it needs the optional gguf package "
                           "(./lab_env/python -m pip install gguf)") from None
    found, infos = read_header(path, _KEYS)
    tensors = {t.name: t for t in infos}
    name = name or _TOKEN_TABLE
    if name not in tensors:
        raise InspectError(f"{path}: no tensor {name!r} (a GGUF token table is {_TOKEN_TABLE!r})")
    tensor = tensors[name]
    shape = tuple(reversed(tensor.dims))  # GGUF lists dims fastest first: [width, vocab]
    if len(shape) != 2 or 0 in shape:
        raise InspectError(f"{path}: {name} is {list(shape)}, not a [vocab, width] table")
    raw = _stored(path, tensor, shape, gguf)
    head = tensors.get(_HEAD)
    tied = head is None or (head.ggml_type == tensor.ggml_type and head.dims == tensor.dims and
                            np.array_equal(_stored(path, head, shape, gguf), raw))
    tokens = _texts(found.get("tokenizer.ggml.tokens"))
    if tokens is not None and len(tokens) != shape[0]:
        tokens = None  # a vocabulary of another size names other rows
    architecture = found.get("general.architecture")
    architecture = architecture if isinstance(architecture, str) else None
    scale = row_scale(architecture, shape[1])
    scores = found.get("tokenizer.ggml.scores")
    model = found.get("tokenizer.ggml.model")
    return Table(model=os.path.abspath(path), name=name, shape=shape, reader=lambda: _decoded(path, raw, tensor, gguf),
                 format=gguf.GGMLQuantizationType(tensor.ggml_type).name, bytes=int(raw.nbytes), tied=bool(tied),
                 head=name if head is None else _HEAD, row_scale=scale,
                 row_scale_is_sqrt_width=None if scale is None else True,
                 folder=os.path.dirname(os.path.abspath(path)), tokens=tokens,
                 merges=_texts(found.get("tokenizer.ggml.merges")),
                 tokenizer_model=model if isinstance(model, str) else None,
                 scores=scores if isinstance(scores, list) and all(isinstance(v, float) for v in scores) else None,
                 architecture=architecture)


def _texts(value):
    """A metadata value that should be a list of strings, or None."""
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def _stored(path, tensor, shape, gguf):
    """The tensor's bytes as they lie in the file, mapped: [vocab, bytes a row] (uint8), checked to lie inside it."""
    try:
        kind = gguf.GGMLQuantizationType(tensor.ggml_type)
        block, size = gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise InspectError(f"{path}: {tensor.name} has ggml type {tensor.ggml_type}, not one gguf decodes") from None
    if shape[1] % block:
        raise InspectError(f"{path}: {tensor.name}'s rows of {shape[1]} are not whole blocks of {block}")
    row = shape[1] // block * size
    if tensor.offset + shape[0] * row > os.path.getsize(path):
        raise InspectError(f"{path}: {tensor.name} runs past the end of the file")
    return np.memmap(path, np.uint8, "r", offset=tensor.offset, shape=(shape[0], row))


DECODE_ROWS = 4096  # rows decoded at a time: gguf's intermediates for them are small, and reused


def _decoded(path, raw, tensor, gguf):
    """The tensor dequantized by gguf to float32 [vocab, width], a block of rows at a time into one array: decoded
    whole, gguf's float intermediates (two tables' worth) would stay in the heap as freed memory glibc does not
    give back."""
    kind = gguf.GGMLQuantizationType(tensor.ggml_type)
    data = {"F32": np.float32, "F16": np.float16}.get(kind.name)
    width = int(np.prod(tensor.dims[:1]))
    out = np.empty((raw.shape[0], width), np.float32)
    try:
        for r0 in range(0, raw.shape[0], DECODE_ROWS):
            block = raw[r0:r0 + DECODE_ROWS]
            out[r0:r0 + len(block)] = gguf.quants.dequantize(block.view(data) if data else block, kind).reshape(
                len(block), width)
    except Exception as e:  # a malformed tensor: gguf raises whatever its decoder meets
        raise InspectError(f"{path}: gguf cannot decode {tensor.name} ({type(e).__name__}: {e})") from None
    return out


SCALED = ("gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding")  # llama.cpp multiplies these architectures'
# looked-up rows by sqrt(n_embd) (its graph builders for Gemma); every other architecture reads them as stored


def row_scale(architecture, width):
    """What llama.cpp multiplies a GGUF architecture's looked-up rows by: sqrt(width) for Gemma's, else None."""
    return float(np.float32(np.sqrt(width))) if architecture in SCALED else None
