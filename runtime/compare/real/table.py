"""A model's token table as compare --model reads it, whatever file it came from (runtime.compare.real.source for
ONNX, gguf_table for GGUF)."""
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Table:
    """A model's token table as compare --model reads it. `values` float32 [vocab, width] (a memory map where the
    model's own float32 bytes could be read in place), None until read() decodes it (`shape` is known before: a
    query is checked against the vocabulary before the table is read); `tied` inspect's finding (a head reads the
    same values), `scored` whether any head scores tokens with a table of its size (none: an encoder);
    `others` the other token tables, not chosen; `zero_rows` the ids of all-zero rows (padding rows: no direction,
    left out of every cosine list), found once the values are read (cli.check_values); `folder` where the tokenizer is looked for; `tokens` / `merges` /
    `tokenizer_model` / `scores`: a GGUF file's vocabulary; `architecture` its general.architecture."""
    model: str
    name: str
    shape: tuple
    format: str
    bytes: int
    tied: bool
    head: str | None
    row_scale: float | None
    row_scale_is_sqrt_width: bool | None
    folder: str
    tokens: list | None = None
    merges: list | None = field(default=None, repr=False)
    tokenizer_model: str | None = None
    scores: list | None = field(default=None, repr=False)
    architecture: str | None = None
    scored: bool = True
    others: list = field(default_factory=list)
    zero_rows: list = field(default_factory=list)
    reader: object = field(default=None, repr=False)
    values: np.ndarray | None = field(default=None, repr=False)

    @property
    def vocab(self):
        return self.shape[0]

    @property
    def width(self):
        return self.shape[1]

    def read(self):
        """Decode the table (once): its values, float32 [vocab, width]."""
        if self.values is None:
            self.values = self.reader()
            self.reader = None
        return self.values
