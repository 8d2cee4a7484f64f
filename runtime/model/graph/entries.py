"""What the walker (graph.walk) finds: a table, whose rows a lookup reads by token id, and a head, the weight of a
matmul that may score every token. Each is made once, where it is found, and read by name everywhere after."""
from dataclasses import dataclass

from onnx import GraphProto, NodeProto

from runtime.model.graph.quantized import Quant


@dataclass(frozen=True, eq=False)
class Entry:
    """A table or a head, as found in one scope of the graph.

    initializer: the initializer that stores it (a view's input, followed back to the weight);
    node: the op that reads it (a Gather, a MatMul of a OneHot, or a matmul of any kind for a head);
    flips: the 2-D Transposes passed from the initializer to the node; views: the view ops passed, in order
    ("View" for a Reshape to the table's own dims);
    stored_dims: the initializer's dims as stored; vocab, width: logical [vocab, width], however it is stored
    (a block-quantized one's from its op's attributes);
    format: one of embed.FORMATS, "int4", or the ONNX type's name; scales: the initializer of its block scales,
    or None; bytes: what it holds on disk, its scales included;
    quant: how to read its values back where it holds codes (a quantized.Quant), else None;
    graph: the scope's path ("main", or a subgraph's: read.model.graph_paths), body: that GraphProto, and the
    scope's producer and consumers maps (graph.scopes: a body's layered on its enclosing scopes')."""
    initializer: str
    node: NodeProto
    flips: int
    views: tuple
    stored_dims: tuple
    vocab: int
    width: int
    format: str
    scales: str | None
    bytes: int
    quant: Quant | None
    graph: str
    body: GraphProto
    producer: dict
    consumers: dict

    @property
    def rows_are_tokens(self):
        """Whether the initializer is stored [vocab, width]: each stored row one token's."""
        return self.flips % 2 == 0


@dataclass(frozen=True, eq=False)
class TableEntry(Entry):
    """A lookup table (Entry's fields), and where its lookup's ids come from.

    ids: the ids a OneHot encodes, for a lookup by multiplication (MatMul of a OneHot by the table), else None
    (the lookup's own ids input: graph.walk.lookup_ids); padded_width: the width of a block-quantized table's
    codes where its rows are cut back to `width` after the lookup (onnxruntime-genai pads int4 rows to whole
    blocks), else None."""
    ids: str | None = None
    padded_width: int | None = None


@dataclass(frozen=True, eq=False)
class HeadEntry(Entry):
    """A matmul weight (Entry's fields) that may score every token, and what its product becomes.

    as_table: whether its initializer is stored [vocab, width] (a weight multiplied transposed: rows are tokens);
    scores: the graph output its product reaches through views, a soft cap, a bias or a scale (graph.reach), or
    None: a layer's weight that happens to be shaped as a table, not a logits head."""
    as_table: bool = False
    scores: str | None = None

    @property
    def rows_are_tokens(self):
        """Whether the initializer is stored [vocab, width]: each stored row one token's."""
        return self.as_table
