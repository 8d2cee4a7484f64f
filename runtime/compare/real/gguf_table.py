"""A GGUF file's token table (`token_embd.weight`) and vocabulary, through the optional gguf package: most models
people hold locally are GGUF. llama.cpp scores with the token table itself when the file has no `output.weight`."""
import os

import numpy as np

from runtime.model.read.text import InspectError

_TOKEN_TABLE, _HEAD = "token_embd.weight", "output.weight"


def _strings(field):
    """A GGUF string array field as Python strings (None when absent)."""
    if field is None:
        return None
    return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]


def _floats(field):
    """A GGUF float array field as Python floats (None when absent)."""
    if field is None:
        return None
    return [float(field.parts[i][0]) for i in field.data]


def _string(field):
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def gguf_table(path, name=None):
    """runtime.compare.real.source.Table of the GGUF file at `path`, dequantized by gguf to float32."""
    try:
        import gguf
    except ImportError:
        raise InspectError(f"{path}: a GGUF file; reading it needs the optional gguf package "
                           "(./lab_env/python -m pip install gguf)") from None
    from runtime.compare.real.source import Table
    try:
        reader = gguf.GGUFReader(path, "r")
        tensors = {t.name: t for t in reader.tensors}
        name = name or _TOKEN_TABLE
        if name not in tensors:
            raise InspectError(f"{path}: no tensor {name!r} (a GGUF token table is {_TOKEN_TABLE!r})")
        tensor = tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest first: [width, vocab]
        head = tensors.get(_HEAD)
        tied = head is None or (head.tensor_type == tensor.tensor_type and np.array_equal(head.data, tensor.data))
        tokens = _strings(reader.fields.get("tokenizer.ggml.tokens"))
        merges = _strings(reader.fields.get("tokenizer.ggml.merges"))
        model = _string(reader.fields.get("tokenizer.ggml.model"))
        scores = _floats(reader.fields.get("tokenizer.ggml.scores"))
        architecture = _string(reader.fields.get("general.architecture"))
        fmt, nbytes = tensor.tensor_type.name, int(tensor.n_bytes)
    except InspectError:
        raise
    except Exception as e:  # a malformed file: gguf raises whatever its parser meets
        raise InspectError(f"{path}: gguf cannot read it ({type(e).__name__}: {e})") from None
    if len(shape) != 2 or 0 in shape:
        raise InspectError(f"{path}: {name} is {list(shape)}, not a [vocab, width] table")
    if tokens is not None and len(tokens) != shape[0]:
        tokens = None  # a vocabulary of another size names other rows
    scale = row_scale(architecture, shape[1])
    return Table(model=os.path.abspath(path), name=name, shape=shape, reader=lambda: _decoded(path, tensor, shape),
                 format=fmt,
                 bytes=nbytes, tied=bool(tied), head=name if head is None else _HEAD, row_scale=scale,
                 row_scale_is_sqrt_width=None if scale is None else True,
                 folder=os.path.dirname(os.path.abspath(path)), tokens=tokens, merges=merges, tokenizer_model=model,
                 scores=scores, architecture=architecture)


def _decoded(path, tensor, shape):
    """The GGUF tensor dequantized by gguf to float32 [vocab, width]."""
    import gguf
    try:
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    except Exception as e:  # a malformed tensor: gguf raises whatever its decoder meets
        raise InspectError(f"{path}: gguf cannot decode {tensor.name} ({type(e).__name__}: {e})") from None
    if values.shape != shape:
        raise InspectError(f"{path}: {tensor.name} decodes to {list(values.shape)}, not {list(shape)}")
    return np.ascontiguousarray(values)


SCALED = ("gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding")  # llama.cpp multiplies these architectures'
# looked-up rows by sqrt(n_embd) (its graph builders for Gemma); every other architecture reads them as stored


def row_scale(architecture, width):
    """What llama.cpp multiplies a GGUF architecture's looked-up rows by: sqrt(width) for Gemma's, else None."""
    return float(np.float32(np.sqrt(width))) if architecture in SCALED else None
