"""--retie --lookup-from-head: a float lookup table whose values a MatMulNBits head already holds as block-quantized
codes is looked up from those codes instead (GatherBlockQuantized, com.microsoft: onnxruntime-genai's shared form).
The float table goes, the head is untouched, and each looked-up row becomes the head's own dequantization of its
token: (code - zero point) x scale, rounded once to the scale's type."""
import dataclasses
from typing import NamedTuple

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from runtime.model.graph import quantized
from runtime.model.graph.quantized import attribute
from runtime.model.findings.headcodes import FLAG
from runtime.model.read.layout import tokenizer_of
from runtime.inspect.retie.edits import const, shell, unique_name, view_of
from runtime.inspect.retie.packed import gather_packed_in_place



class Lookup(NamedTuple):
    """One lookup the flag rewrote: its output (the looked-up rows, named as before), the ids it reads, the float
    table it read (as the original stores it; `transposed` when [width, vocab]), the head codes it reads now, and
    the head (a HeadEntry) as it is now, and whether --shared-int8 made its codes anew from the float table
    (`requantized`: the original never held them)."""
    output: str
    ids: str
    table: str
    transposed: bool
    codes: str
    head: object = None
    requantized: bool = False


def lookup_from_head(graph, model, table, head, sources):
    """Make the Gather of `table` (an entry whose pair headcodes.why_not accepts) a GatherBlockQuantized on `head`'s codes,
    scales and zero points, read in place (retie.packed.gather_packed_in_place: [N, blocks, blob] codes, a run-time
    view of the scales, one Reshape of the rows). MatMulNBits packs 4-bit zero points two a byte; the op reads
    one a byte: those are stored anew in `sources` (vocab x blocks bytes, a quarter of float32 scales). The Lookup,
    or None."""
    node, q = table.node, head.quant
    found = Lookup(node.output[0], node.input[1], table.initializer, not table.rows_are_tokens,
                   head.initializer, head)
    inputs = [head.initializer, node.input[1], q.scale]
    if q.zero_point:
        name = unique_name(model, q.zero_point + "_per_block")
        sources[name] = shell(graph, name, unpacked_zero_points(model, q, table.vocab, head.stored_dims[1]))
        inputs.append(name)
    node.op_type, node.domain = "GatherBlockQuantized", "com.microsoft"
    node.doc_string = f"rows looked up from the head's codes {head.initializer} (retied by runtime.inspect {FLAG})"
    del node.input[:]
    node.input.extend(inputs)
    del node.attribute[:]
    node.attribute.extend([helper.make_attribute("gather_axis", 0), helper.make_attribute("bits", q.bits),
                           helper.make_attribute("block_size", attribute(head.node, "block_size"))])
    twin = dataclasses.replace(table, initializer=head.initializer, scales=q.scale, stored_dims=head.stored_dims,
                               padded_width=None)
    return found if gather_packed_in_place(graph, model, twin) else None


def decoded_lookup(graph, model, table, head, sources):
    """Make the Gather of `table` a lookup of `head`'s codes in standard ONNX ops, for runtimes with no
    GatherBlockQuantized kernel (onnxruntime-web's WASM): the rows of the [N, blocks, blob] codes gathered as they
    lie, each byte split into its two 4-bit codes (BitShift, low nibble first), Cast to the scales' type, less the
    zero point, times the row's scales, reshaped to [..., width]. The same rows as lookup_from_head's, computed in
    the same order (one rounding, in the product); the codes and scales read in place. The Lookup."""
    node, q = table.node, head.quant
    found = Lookup(node.output[0], node.input[1], table.initializer, not table.rows_are_tokens,
                   head.initializer, head)
    ids, p = node.input[1], unique_name(model, "rows_from_head") + "_"
    (vocab, blocks, blob), kind = head.stored_dims, model.tensors[q.scale].data_type
    block = blob * 8 // q.bits
    make = lambda op, inputs, name, **attrs: helper.make_node(op, inputs, [p + name], name=p + name, **attrs)
    nodes = [make("Gather", [head.initializer, ids], "codes"), make("Shape", [ids], "ids_shape")]  # [..., blocks, blob]
    codes = p + "codes"
    if q.bits == 4:
        four = _scalar(graph, p + "four", np.uint8(4))
        nodes += [make("BitShift", [codes, four], "high", direction="RIGHT"),
                  make("BitShift", [p + "high", four], "high_back", direction="LEFT"),
                  make("Sub", [codes, p + "high_back"], "low"),
                  make("Unsqueeze", [p + "low", const(graph, p + "last", [-1])], "low_1"),
                  make("Unsqueeze", [p + "high", p + "last"], "high_1"),
                  make("Concat", [p + "low_1", p + "high_1"], "pairs", axis=-1)]  # [..., blocks, blob, 2]
        codes = p + "pairs"
    nodes += [make("Concat", [p + "ids_shape", const(graph, p + "blocks_shape", [blocks, block])], "to_blocks", axis=0),
              make("Reshape", [codes, p + "to_blocks"], "blocks"), make("Cast", [p + "blocks"], "values", to=kind)]
    if q.zero_point:
        points = unique_name(model, q.zero_point + "_per_block")
        sources[points] = shell(graph, points, unpacked_zero_points(model, q, vocab, blocks))
        nodes += [make("Gather", [points, ids], "points"), make("Cast", [p + "points"], "points_cast", to=kind),
                  make("Unsqueeze", [p + "points_cast", const(graph, p + "at_end", [-1])], "zero")]
        zero = p + "zero"
    else:  # MatMulNBits' default: the middle code
        zero = _scalar(graph, p + "zero", np.array(2 ** (q.bits - 1), helper.tensor_dtype_to_np_dtype(kind)))
    scales = q.scale
    if len(model.tensors[q.scale].dims) != 2:  # stored flat: read [N, blocks] through a run-time view, no copy
        scales = view_of(graph, model, node, q.scale, ids, [vocab, blocks])
    nodes += [make("Sub", [p + "values", zero], "centered"), make("Gather", [scales, ids], "scales"),
              make("Unsqueeze", [p + "scales", const(graph, p + "scale_axis", [-1])], "scales_1"),
              make("Mul", [p + "centered", p + "scales_1"], "rows"),
              make("Concat", [p + "ids_shape", const(graph, p + "width", [table.width])], "to_rows", axis=0),
              helper.make_node("Reshape", [p + "rows", p + "to_rows"], [node.output[0]], name=p + "unblocked",
                               doc_string=f"rows decoded from the head's codes {head.initializer} (retied by "
                                          f"runtime.inspect {FLAG})")]
    at = list(graph.node).index(node)
    graph.node.remove(node)
    for offset, n in enumerate(nodes):
        graph.node.insert(at + offset, n)
    return found


def _scalar(graph, name, value):
    """A scalar initializer `name` holding `value` (its numpy type); its name."""
    graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return name


TEXTS = ("The capital of France is", "Once upon a time, there was", "def fibonacci(n):", "Water boils at",
         "The best way to learn a language is", "In 1969, the first", "My favourite food is", "Dear Sir or Madam,")


def prompts_for(model_path, vocab):
    """The greedy runs' prompts: TEXTS made ids by the model's tokenizer.json (layout.tokenizer_of), special tokens
    added as a client adds them, every id below `vocab`; None where there is no tokenizer (or the tokenizers
    library), and the runs take fixed ids."""
    tokenizer = tokenizer_of(model_path)
    if tokenizer is None:
        return None
    made = [tokenizer.encode(text).ids for text in TEXTS]
    return made if all(made) and all(0 <= i < vocab for ids in made for i in ids) else None


def unpacked_zero_points(model, q, vocab, blocks):
    """MatMulNBits' zero points (uint8: two 4-bit ones a byte, low nibble first, each row padded to whole bytes;
    8-bit ones one a byte) one a byte, uint8 [vocab, blocks], as GatherBlockQuantized reads them."""
    points = np.asarray(model.tensors[q.zero_point].values(), np.uint8).reshape(vocab, -1)
    if q.bits == 4:
        points = np.stack([points & 15, points >> 4], axis=-1).reshape(vocab, -1)
    return np.ascontiguousarray(points[:, :blocks])


def head_rows(model, head, table, path):
    """Write the head's own dequantization of every token ([vocab, width], the table's type: (code - zero point) x
    scale exact in float64, rounded once to the scale's type) to the .npy `path`, a chunk of tokens at a time, and
    measure each row's change from the table's: {"max_row_change", "max_row_change_in_steps"} (the largest
    |new - old| of an element, and of it over its block's scale: the quantization step)."""
    q, tensor = head.quant, model.tensors[table.initializer]
    dtype = np.float16 if tensor.data_type == TensorProto.FLOAT16 else np.float32
    values = tensor.values()
    values = values if table.rows_are_tokens else values.T  # [vocab, width], a view
    rows = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(table.vocab, table.width))
    most, most_steps = 0.0, 0.0
    for t0, t1 in quantized.chunks(table.vocab, table.width):
        exact, scales = quantized.decoded(model, q, t0, t1)
        rows[t0:t1] = exact.astype(dtype)  # one rounding: the product of a small integer and a scale is exact
        change = np.abs(rows[t0:t1].astype(np.float64) - np.asarray(values[t0:t1], np.float64))
        most = max(most, float(change.max(initial=0.0)))
        most_steps = max(most_steps, float(np.max(quantized.steps(change, scales), initial=0.0)))
    rows.flush()
    del rows
    return {"max_row_change": most, "max_row_change_in_steps": round(most_steps, 4)}
