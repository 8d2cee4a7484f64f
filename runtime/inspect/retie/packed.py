"""--retie's int4 forms: onnxruntime-genai's GatherBlockQuantized on a Reshape of MatMulNBits' packed codes, and
onnxruntime's MatMulNBitsQuantizer writing the codes twice, each made into one lookup that reads the head's codes in
place."""
import dataclasses

from onnx import helper

from graphs.tie import unfolded_view
from runtime.model.graph.quantized import attribute
from runtime.inspect.retie.edits import const, unique_name


def packed_shared(pair):
    """onnxruntime-genai's int4 tie: GatherBlockQuantized on a Reshape of the [N, blocks, blob] codes that
    MatMulNBits reads (onnxruntime folds the Reshape into a second packed table)."""
    table, head = pair.table_entry, pair.head_entry
    return (pair.relation == "shared" and table.node.op_type == "GatherBlockQuantized"
            and head.node.op_type == "MatMulNBits" and table.views == ("Reshape",) and not head.views
            and len(table.stored_dims) == 3)


def packed_in_place(pair):
    """What packed_shared and --lookup-from-head are rewritten to: GatherBlockQuantized on the very [N, blocks, blob]
    codes MatMulNBits reads, no Reshape between (one table in the file; the kernel's prepacked copy is its own)."""
    table, head = pair.table_entry, pair.head_entry
    return (pair.relation == "shared" and table.node.op_type == "GatherBlockQuantized"
            and head.node.op_type == "MatMulNBits" and not table.views and len(table.stored_dims) == 3)


def packed_duplicate(pair):
    """onnxruntime's MatMulNBitsQuantizer with Gather quantized: GatherBlockQuantized on ONNX INT4 / UINT4 [V, D]
    codes and MatMulNBits on the same codes and scales again in its block layout [V, blocks, blob]."""
    table, head = pair.table_entry, pair.head_entry
    return (pair.relation == "duplicate" and table.node.op_type == "GatherBlockQuantized"
            and head.node.op_type == "MatMulNBits" and not table.views and not head.views
            and len(table.stored_dims) == 2 and len(head.stored_dims) == 3 and head.scales is not None)


def gather_head_codes(graph, model, table, head):
    """Make the lookup of a _packed_duplicate read the head's codes and scales (proven to decode to the same values,
    scale for scale): _gather_packed_in_place on them, with the head's block, bits and zero points."""
    node = table.node
    block, bits = attribute(head.node, "block_size"), attribute(head.node, "bits", 4)
    if not block:
        return False
    blocks = head.stored_dims[1]
    padded = blocks * block
    twin = dataclasses.replace(table, initializer=head.initializer, scales=head.scales, stored_dims=head.stored_dims,
                               padded_width=None if padded == table.width else padded)
    del node.input[3:]  # the table's own zero points (if any) went with its codes; the head's come instead
    if len(head.node.input) > 3 and head.node.input[3]:
        node.input.append(head.node.input[3])
    if not gather_packed_in_place(graph, model, twin):
        return False
    kept = [a for a in node.attribute if a.name not in ("block_size", "bits")]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute("block_size", block), helper.make_attribute("bits", bits)])
    return True


def gather_packed_in_place(graph, model, table):
    """Make GatherBlockQuantized read the [N, blocks, blob] codes themselves (no Reshape to fold): its scales
    then need the codes' rank, [N, blocks, 1], which it reads through a run-time view of MatMulNBits' own
    [N, blocks] ones (graphs.tie: nothing folds it into a second scales tensor), and its rows come out
    [..., blocks, block], so one Reshape of the looked-up rows (not of the table) restores [..., width] (the
    ids' shape, found at each run, where their rank is not declared). False when the table has no scales."""
    node = table.node
    if table.scales is None:
        return False
    ids_rank = _rank(graph, node.input[1])
    codes = table.initializer
    blocks = table.stored_dims[1]
    scales3 = _blocks_view(graph, model, node, table.scales, [table.vocab, blocks, 1], "retie_scales")
    if len(node.input) > 3 and node.input[3]:  # its zero points, one a byte, read through a view as the scales are
        node.input[3] = _blocks_view(graph, model, node, node.input[3], [table.vocab, blocks, 1], "retie_points")
    output = node.output[0]
    blocked = unique_name(model, output + "_blocks")
    node.input[0], node.input[2], node.output[0] = codes, scales3, blocked
    kept = [a for a in node.attribute if a.name != "quantize_axis"]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute("quantize_axis", 2)])
    width = table.padded_width or table.width  # the padded width: the model's Slice follows
    at = list(graph.node).index(node) + 1
    if ids_rank is not None:
        shape = const(graph, unique_name(model, output + "_shape"), [0] * ids_rank + [width])
    else:  # the ids' rank is not declared: the rows' shape is the ids' own, then the width, found at each run
        shape, ids_shape = unique_name(model, output + "_shape"), unique_name(model, output + "_ids_shape")
        graph.node.insert(at, helper.make_node("Shape", [node.input[1]], [ids_shape], name=ids_shape))
        graph.node.insert(at + 1, helper.make_node(
            "Concat", [ids_shape, const(graph, unique_name(model, output + "_width"), [width])], [shape], name=shape,
            axis=0))
        at += 2
    graph.node.insert(at, helper.make_node("Reshape", [blocked, shape], [output], name=unique_name(model, "rows_of_blocks"),
                                           doc_string="looked-up rows [..., blocks, block] -> [..., width]"))
    return True


def _blocks_view(graph, model, node, name, dims, prefix):
    """graphs.tie's run-time view of initializer `name` as `dims`, inserted before `node` (anchored on its ids, so
    nothing folds it into a tensor of its own), its shape declared (GatherBlockQuantized's shape inference compares
    its zero points' and scales' shapes, and a view's would be unknown): the view's name."""
    out = unique_name(model, name + "_blocks")
    kind = model.tensors[name].data_type if name in model.tensors else next(  # or one this retie stores anew
        t.data_type for t in model.proto.graph.initializer if t.name == name)
    graph.value_info.append(helper.make_tensor_value_info(out, kind, dims))
    view, constants, _ = unfolded_view(name, node.input[1], dims, out, unique_name(model, prefix) + "_")
    for constant, values in constants.items():
        const(graph, constant, values)
    at = list(graph.node).index(node)
    for offset, n in enumerate(view):
        graph.node.insert(at + offset, n)
    return out


def _rank(graph, name):
    for value in list(graph.input) + list(graph.value_info):
        if value.name == name and value.type.tensor_type.HasField("shape"):
            return len(value.type.tensor_type.shape.dim)
    return None
