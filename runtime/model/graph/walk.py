"""Walking the graph: one topological order (a cycle is a finding), then tables and heads found through it."""
import math
from typing import NamedTuple

from onnx import TensorProto

from graphs.precision import format_name
from graphs.tie import viewed_dims
from runtime.model.graph.constants import small_ints
from runtime.model.graph.entries import HeadEntry, TableEntry
from runtime.model.graph.ops import INTEGER_MATMULS, MATMULS
from runtime.model.graph.quantized import Quant, attribute, dq_quant, gathered_quant, gbq_quant, integer_quant
from runtime.model.graph.reach import ScoredOutputs
from runtime.model.graph.scopes import scopes
from runtime.model.read.model import label
from runtime.model.read.text import InspectError

# Ops exporters put between a stored table and the op that reads it; each passes on its input 0's values.
_VIEWS = ("Identity", "Transpose", "Reshape", "Cast", "Squeeze", "Unsqueeze", "DequantizeLinear")
# A Reshape to the table's own dims computed at run time (graphs.tie) is listed as a "View": nothing changes.


class Resolver:
    """Follows a tensor back through views (Identity, 2-D Transpose, Reshape, Cast, Squeeze, Unsqueeze,
    DequantizeLinear) to the initializer it shows, memoised."""

    def __init__(self, producer, weights):
        self.producer, self.weights, self.known = producer, weights, {}

    def __call__(self, name):
        """(initializer, transposes passed, ops passed) or None. Terminates: check_order has ruled out cycles."""
        chain = []
        while name not in self.known:
            if name in self.weights:
                self.known[name] = (name, 0, ())
                break
            node = self.producer.get(name)
            if node is None or node.op_type not in _VIEWS or not node.input:
                self.known[name] = None
                break
            if node.op_type == "Transpose":
                perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
                if perm and perm[0] != [1, 0]:
                    self.known[name] = None
                    break
            chain.append((name, "View" if self._same_shape(node) else node.op_type))
            name = node.input[0]
        found = self.known[name]
        for step, op in reversed(chain):
            found = None if found is None else (found[0], found[1] + (op == "Transpose"), found[2] + (op,))
            self.known[step] = found
        return found

    def _same_shape(self, node):
        """Whether a Reshape gives its input back in the dims it has (graphs.tie's run-time view of a table)."""
        if node.op_type != "Reshape" or len(node.input) < 2 or node.input[0] not in self.weights:
            return False
        return viewed_dims(node.input[1], self.producer, self._constant) == self.weights[node.input[0]].dims

    def _constant(self, name):
        tensor = self.weights.get(name)
        if tensor is None or tensor.data_type != TensorProto.INT64 or tensor.elements > 8:
            return None
        return tensor.values()


def _format(tensor, bits=None):
    """One of embed.FORMATS for a stored table, or the ONNX type name; packed uint8 codes with bits=4 are int4."""
    if bits == 4 and tensor.data_type in (TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4):
        return "int4"
    return format_name(tensor.data_type)


class Blocks(NamedTuple):
    """What a block-quantized table or head's op says of it: its scales' initializer, bits a code, [vocab, width]."""
    scales: str | None
    bits: int
    vocab: int
    width: int


class Scope(NamedTuple):
    """One scope of the graph as the finders read it: its path, body and maps (graph.scopes), the Resolver of its
    weights, and the ScoredOutputs of its heads."""
    path: str
    body: object
    producer: dict
    consumers: dict
    resolve: Resolver
    scored: ScoredOutputs


def _entry(model, found, node, role, scope, blocks=None):
    """The fields an Entry (graph.entries) shares, as keywords, for the table or head found: its initializer, the op,
    the view taken, logical [vocab, width] and its bytes, and its scope; `blocks` where the op gives them (a plain
    float table's are its 2-D dims, as read). None where it has no rows or no columns, or no 2-D [vocab, width]."""
    tensor = model.tensors[found[0]]
    scales, bits, vocab, width = blocks or (None, None, None, None)
    if vocab is None:  # a plain 2-D float table: [vocab, width] as stored, or [width, vocab] read transposed
        dims = tensor.dims if len(tensor.dims) == 2 else None
        if dims is None or "Reshape" in found[2]:
            return None
        vocab, width = dims if (found[1] + (role == "head")) % 2 == 0 else dims[::-1]
    if not vocab or not width:  # no rows or no columns: nothing is looked up or scored
        return None
    scale_bytes = model.tensors[scales].nbytes if scales in model.tensors else 0
    return {"initializer": found[0], "node": node, "flips": found[1], "views": tuple(found[2]),
            "stored_dims": tuple(tensor.dims), "vocab": vocab, "width": width, "format": _format(tensor, bits),
            "scales": scales, "bytes": tensor.nbytes + scale_bytes, "graph": scope.path, "body": scope.body,
            "producer": scope.producer, "consumers": scope.consumers}


def find_tables_and_heads(model):
    """([TableEntry], [HeadEntry]) of a checked Model (graph.entries): tables (what a Gather or GatherBlockQuantized
    reads rows from, or a MatMul multiplies a OneHot of ids by) and heads (the weight of a MatMul, Gemm, FusedMatMul,
    MatMulNBits or an integer matmul: MatMulInteger, DynamicQuantizeMatMul, QLinearMatMul), in the main graph and in
    every subgraph (an If branch of a merged decoder reads the main graph's initializers as outer-scope values). A
    body's own initializers are not followed (none of the exporters tried writes any)."""
    tables, heads, seen = [], [], set()
    for path, graph, order, producer, consumers in scopes(model.proto.graph):
        local = {t.name for t in graph.initializer} if path != "main" else set()
        weights = {k: v for k, v in model.tensors.items() if k not in local} if local else model.tensors
        scope = Scope(path, graph, producer, consumers, Resolver(producer, weights),
                      ScoredOutputs(producer, consumers, graph))  # one walk of the scope for all its heads
        for node in order:  # each node asked first whether it looks rows up, then whether it scores with a weight
            lookup = _LOOKUPS.get(node.op_type)
            entry = lookup(model, node, scope, seen) if lookup else None
            if entry:
                seen.add(entry.initializer)
                tables.append(entry)
                continue
            head = _HEADS.get(node.op_type)
            entry = head(model, node, scope) if head else None
            if entry:
                heads.append(entry)
    return tables, heads


def _gather(model, node, scope, seen):
    """Gather(table, ids): rows of a float table, of codes decoded on the way (QDQ), or of codes decoded after."""
    found = scope.resolve(node.input[0]) if len(node.input) >= 2 else None
    fields = _entry(model, found, node, "table", scope) if found and found[0] not in seen else None
    if fields is None:
        return None
    if "DequantizeLinear" in found[2]:  # QDQ: codes decoded on the way to the lookup
        quant = dq_quant(model, found[0], scope.consumers, found[1] % 2 == 0, fields["width"])
    else:  # integer codes decoded after the lookup (quantize_dynamic's Gather), or plain floats
        quant = gathered_quant(model, found[0], node, found[1] % 2, fields["width"], scope.producer, scope.consumers)
    return TableEntry(**fields, quant=quant)


def _gather_block_quantized(model, node, scope, seen):
    """GatherBlockQuantized(codes, ids, scales): rows of block-quantized codes, maybe padded to whole blocks."""
    found = scope.resolve(node.input[0]) if len(node.input) >= 3 else None
    if not found or found[0] in seen:
        return None
    scales = scope.resolve(node.input[2])
    block = attribute(node, "block_size", 128)
    rows = model.tensors[found[0]].dims
    blocks = model.tensors[scales[0]].dims if scales else []
    width = math.prod(blocks[1:]) * block if len(blocks) > 1 and isinstance(block, int) and block > 0 else 0
    codes = model.tensors[found[0]]
    if len(rows) == 2 and codes.data_type in (TensorProto.INT4, TensorProto.UINT4):
        width = min(width, rows[1])  # one block wider than the row: the codes' own columns are the width
    fields = _entry(model, found, node, "table", scope, Blocks(scales[0], attribute(node, "bits", 4), rows[0], width)
                    ) if width > 0 and rows and rows[0] > 0 else None
    if fields is None:
        return None
    kept = _sliced_width(node, width, scope.producer, scope.consumers, model)
    padded = width if kept < width else None  # codes padded to whole blocks, the rows cut back to the true width
    return TableEntry(**{**fields, "width": kept}, padded_width=padded,
                      quant=gbq_quant(node, found[0], scales[0], model.tensors[found[0]], block, kept))


def _one_hot_product(model, node, scope, seen):
    """MatMul(one_hot(ids), table): a lookup by multiplication, rows are tokens."""
    ids = _one_hot_ids(node.input[0], scope.producer) if len(node.input) == 2 else None
    found = scope.resolve(node.input[1]) if ids else None
    fields = _entry(model, found, node, "table", scope) if found and found[1] % 2 == 0 and found[0] not in seen \
        else None
    return fields and TableEntry(**fields, quant=None, ids=ids)


def _matmul_head(model, node, scope):
    """The weight of a MatMul, Gemm or FusedMatMul, stored [vocab, width] when its transposes and transB add up
    odd; codes decoded on the way (QDQ) carry their quant."""
    weight = scope.resolve(node.input[1]) if len(node.input) >= 2 else None
    fields = _entry(model, weight, node, "head", scope) if weight else None
    if fields is None:
        return None
    transposed = MATMULS[node.op_type].transposed
    trans_b = attribute(node, transposed, 0) if transposed else 0
    as_table = (weight[1] + trans_b) % 2 == 1
    if trans_b:
        fields.update(vocab=fields["width"], width=fields["vocab"])
    quant = dq_quant(model, weight[0], scope.consumers, as_table, fields["width"]) \
        if "DequantizeLinear" in weight[2] else None  # QDQ: the codes, decoded on the way to the matmul
    return HeadEntry(**fields, quant=quant, as_table=as_table, scores=scope.scored(node))


def _matmul_nbits_head(model, node, scope):
    """MatMulNBits' [N, K] blocks of codes: rows are tokens."""
    weight = scope.resolve(node.input[1]) if len(node.input) >= 3 else None
    if not weight:
        return None
    if not all(isinstance(attribute(node, k), int) and attribute(node, k) > 0 for k in ("N", "K")):
        raise InspectError(f"MatMulNBits node {label(node)!r} has no positive N and K: not a valid model")
    scales = scope.resolve(node.input[2])
    fields = _entry(model, weight, node, "head", scope, Blocks(scales and scales[0], attribute(node, "bits", 4),
                                                               attribute(node, "N"), attribute(node, "K")))
    quant = Quant(weight[0], scales and scales[0], node.input[3] if len(node.input) > 3 else None,
                  attribute(node, "bits", 4), True, width=attribute(node, "K") or 0)
    return HeadEntry(**fields, quant=quant, as_table=True,  # MatMulNBits keeps [N, K] blocks: rows are tokens
                     scores=scope.scored(node))


def _integer_head(model, node, scope):
    """A head for an integer matmul's weight [width, vocab] (codes, decoded by its scale and zero point)."""
    index = MATMULS[node.op_type].weight
    weight = scope.resolve(node.input[index]) if len(node.input) > index and node.input[index] else None
    fields = _entry(model, weight, node, "head", scope) if weight else None
    if fields is None:
        return None
    quant = integer_quant(node, weight[0], weight[1] % 2, fields["width"], scope.producer, scope.consumers, model)
    return HeadEntry(**fields, quant=quant, as_table=weight[1] % 2 == 1, scores=scope.scored(node))


def lookup_rows(tables):
    """{ids input: vocab}: each lookup's ids, and the rows they may name (the decoder feeds' bound)."""
    return {lookup_ids(t): t.vocab for t in tables}


def lookup_ids(table):
    """The input a TableEntry's lookup takes its ids from (Gather's indices, or what its OneHot encodes)."""
    return table.ids or table.node.input[1]


def _one_hot_ids(name, producer):
    """The ids a OneHot (seen through a Cast) encodes into `name`, or None."""
    node = producer.get(name)
    if node is not None and node.op_type == "Cast" and node.input:
        node = producer.get(node.input[0])
    return node.input[0] if node is not None and node.op_type == "OneHot" and node.input else None


def _sliced_width(node, width, producer, consumers, model):
    """The width a lookup's rows are cut to: every reader of its output a Slice of the last axis from 0 to an end
    below `width` (onnxruntime-genai pads int4 codes to whole blocks), past a Reshape of the rows to [..., width]
    (--retie's, after a lookup of blocks); else `width`."""
    out = node.output[0] if node.output else None
    readers = consumers.get(out, [])
    if len(readers) == 1 and readers[0].op_type == "Reshape" and len(readers[0].input) > 1 and readers[0].output:
        target = small_ints(readers[0].input[1], producer, model)
        if target and target[-1] == width:
            out = readers[0].output[0]
            readers = consumers.get(out, [])
    ends = set()
    for reader in readers:
        args = [small_ints(n, producer, model) if n else None for n in list(reader.input[1:5]) + [""] * 4][:4]
        starts, end, axes, steps = args
        if reader.op_type != "Slice" or reader.input[0] != out or starts != [0] or axes != [-1] \
                or steps not in (None, [1]) or not end or not 0 < end[0] < width:
            return width
        ends.add(end[0])
    return ends.pop() if len(ends) == 1 else width


_LOOKUPS = {"Gather": _gather, "GatherBlockQuantized": _gather_block_quantized, "MatMul": _one_hot_product}

_HEADS = {op: _integer_head if op in INTEGER_MATMULS else _matmul_nbits_head if facts.bits else _matmul_head
          for op, facts in MATMULS.items()}  # each op that multiplies by a weight (graph.ops)
