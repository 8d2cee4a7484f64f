"""--retie --shared-int8: where a float lookup table's values are held again as a MatMulNBits head's block codes, one
int8 table for both. The head's codes are made anew from the float table (BLOCK values a block along the width,
symmetric: code = round(value / scale) + 128 with scale = the block's largest |value| / 127, rounded once to the
head's scale type; no zero points stored: MatMulNBits' default for 8 bits is 128), the head reads them with bits=8,
and the lookup reads the same codes (retie.headlookup: GatherBlockQuantized, or standard ops for a client with no
kernel for it). The float table and the head's old codes go; every looked-up row is (code - 128) x scale, rounded
once, bit for bit, and what the requantization costs the model is measured (retie.quality)."""
import dataclasses

import numpy as np
from onnx import helper, numpy_helper

from runtime.model.graph.quantized import Quant, chunks
from runtime.model.read.model import Tensor
from runtime.inspect.retie.edits import shell, unique_name

FLAG = "--shared-int8"
BLOCK = 32  # as GGUF's Q8_0 and the 4-bit exports' own blocks: a table made from a Q8_0 GGUF comes back exactly
MIDDLE = 128  # MatMulNBits' zero point for 8-bit codes where none is stored
ACCURACY = 4  # the head's accuracy_level at least: int8 products (onnxruntime 1.32's CPU kernel for 8-bit codes
# otherwise decodes the whole table at each call: SmolLM2's decoding step 12.4 -> 128.6 ms; at 4, 13-14 ms, its
# mean KL from the float model 0.2567 -> 0.2576 nats: BENCHMARKS.md, "One table, two ways")
ATTRIBUTES = ("bits", "block_size", "accuracy_level")


def requantized(values, scale_type, block=BLOCK):
    """(codes uint8 [vocab, blocks, block], scales [vocab, blocks] of `scale_type`) of a float table [vocab, width]
    whose width is whole blocks: symmetric int8 per block, the scale the block's largest |value| / 127 rounded once
    to `scale_type`, each code round(value / scale) (half to even, in float64) clipped to +-127, plus 128. A block
    of zeros gets scale 0 and codes 128."""
    vocab, width = values.shape
    blocks = width // block
    codes = np.empty((vocab, blocks, block), np.uint8)
    scales = np.empty((vocab, blocks), scale_type)
    for t0, t1 in chunks(vocab, width):
        x = np.asarray(values[t0:t1], np.float64).reshape(t1 - t0, blocks, block)
        scale = (np.max(np.abs(x), axis=-1) / 127).astype(scale_type)
        scales[t0:t1] = scale
        wide = scale.astype(np.float64)[..., None]
        steps = np.divide(x, wide, out=np.zeros_like(x), where=wide > 0)
        codes[t0:t1] = (np.clip(np.rint(steps), -127, 127) + MIDDLE).astype(np.uint8)
    return codes, scales


def share_int8(graph, model, table, head, sources):
    """Make `head` (a MatMulNBits HeadEntry whose pair with the float `table` headcodes.why_not accepts) multiply
    int8 codes requantized from the table (requantized(), stored anew in `sources` and registered in model.tensors),
    bits=8, no zero points, accuracy_level at least ACCURACY; the head's old codes, scales and zero points are no
    longer read. Returns the HeadEntry as it is now, for retie.headlookup to point the lookup at the same codes."""
    node, old = head.node, head.quant
    values = model.tensors[table.initializer].values()
    values = values if table.rows_are_tokens else values.T
    scale_type = helper.tensor_dtype_to_np_dtype(model.tensors[old.scale].data_type)
    codes, scales = requantized(values, scale_type)
    names = unique_name(model, head.initializer + "_int8"), unique_name(model, old.scale + "_int8")
    for name, array in zip(names, (codes, scales)):
        sources[name] = shell(graph, name, array)
        model.tensors[name] = Tensor(numpy_helper.from_array(array, name), array.nbytes)
    node.input[1], node.input[2] = names
    if len(node.input) > 3:
        node.input[3] = ""  # MatMulNBits' default zero point, 128
        while node.input and not node.input[-1]:
            node.input.pop()
    accuracy = max(ACCURACY, next((a.i for a in node.attribute if a.name == "accuracy_level"), 0))
    kept = [a for a in node.attribute if a.name not in ATTRIBUTES]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute("bits", 8), helper.make_attribute("block_size", BLOCK),
                                  helper.make_attribute("accuracy_level", accuracy)])
    node.doc_string = f"int8 codes requantized from {table.initializer}, shared with its lookup ({FLAG})"
    quant = Quant(names[0], names[1], None, 8, True, width=table.width)
    return dataclasses.replace(head, initializer=names[0], stored_dims=list(codes.shape), quant=quant)


def saved_bytes(model, table, head):
    """The bytes on disk --shared-int8 saves for a pair: the float table and the head's codes, scales and zero
    points, less the int8 codes and scales that replace them."""
    q, tensors = head.quant, model.tensors
    before = tensors[table.initializer].nbytes + sum(tensors[n].nbytes for n in (q.codes, q.scale, q.zero_point)
                                                     if n in tensors)
    blocks = -(-table.width // BLOCK)
    return before - table.vocab * blocks * (BLOCK + tensors[q.scale].nbytes // max(1, tensors[q.scale].elements))
