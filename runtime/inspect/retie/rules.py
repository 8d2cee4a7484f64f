"""What --retie does with each table/head pair, decided here and nowhere else."""
from typing import NamedTuple

from runtime.model.findings.headcodes import FLAG
from runtime.inspect.retie import int8share
from runtime.inspect.retie.packed import packed_duplicate, packed_in_place, packed_shared

FLOATS = ("float32", "float16", "bfloat16")  # the tables a head reads through the view (float16 / bfloat16: in
# their own format, or through the Cast the head read them by, rewrite.cast_to)


LOOKUP_FROM_HEAD, SHARED_INT8 = "lookup_from_head", "shared_int8"  # the rewrites that change values, opt-in


class Lossy(NamedTuple):
    """A rewrite asked for that changes values: `kind` LOOKUP_FROM_HEAD (--lookup-from-head: the lookup reads the
    head's own codes) or SHARED_INT8 (--shared-int8: one int8 table requantized from the float one, read by both);
    `decoded`: the lookup written in standard ops (a transformers.js folder: onnxruntime-web has no
    GatherBlockQuantized kernel)."""
    kind: str
    decoded: bool = False


WHY_NOT_PACKED = ("MatMulNBits prepacks its own copy of the int4 codes at load, whatever the file holds: no rewrite "
                  "of the file removes it")


def remedy(pair, lossy=None):
    """What --retie does with a table/head pair, decided here and nowhere else: (how, why). `how` is "packed_shared",
    "packed_duplicate" or "view" (the head, and a OneHot product's lookup, read the one table through graphs.tie's
    run-time view; a head becomes a Gemm(transB=1) on it; a float32, float16 or bfloat16 table and head of one
    format), LOOKUP_FROM_HEAD or SHARED_INT8 (asked for by `lossy`, a Lossy: the float lookup reads the quantized
    head's codes, retie.headlookup, or both read int8 codes made anew, retie.int8share), or None when the pair is
    left as it is; `why` then says
    why in one line where the pair holds one table's values twice (None where there is nothing to say)."""
    table, head, relation = pair.table_entry, pair.head_entry, pair.relation
    if relation == "distinct":
        return None, None
    inside = [g for g in (table.graph, head.graph) if g != "main"]
    if any(not _in_branches(g) for g in inside):
        return None, (f"read inside a Loop or Scan body ({inside[0]}): found and counted, but --retie rewrites the "
                      "main graph and If branches only")
    if relation == "quantized_copy":
        found = pair.head_lookup
        if found is not None and found.possible:
            if lossy is not None and lossy.kind == SHARED_INT8 and table.width % int8share.BLOCK:
                return None, (f"a width of {table.width} is not whole blocks of {int8share.BLOCK}: --shared-int8 "
                              "leaves it as it is")
            if lossy is not None:
                return lossy.kind, None
            return None, (f"a quantized copy: {FLAG} makes the lookup read the head's codes, --shared-int8 both read "
                          "one int8 table (opt-in: the values then change by up to a quantization step)")
        return None, ("a quantized copy, not a tie: its values differ from the table's by rounding, so neither can "
                      "read the other's without changing the outputs" + (f" ({FLAG}: {found.why_not})" if found else ""))
    if packed_in_place(pair):
        return None, WHY_NOT_PACKED
    if (packed_shared(pair) or packed_duplicate(pair)) and inside:
        return None, f"an int4 tie inside an If branch ({inside[0]}): found and counted, not rewritten there yet"
    if packed_shared(pair):
        return "packed_shared", None
    if packed_duplicate(pair):
        return "packed_duplicate", None
    views = table.views + head.views
    if table.format not in FLOATS or head.format != table.format:
        return None, (f"a {table.format} table read through {', '.join(views) or 'no view'} by "
                      f"{table.node.op_type}: left as it is (--retie rewrites float32, float16 and bfloat16 tables "
                      "with a head of the same format, and onnxruntime's int4 block layouts)")
    if "Cast" in table.views:  # the lookup would read the table in another type than it did
        return None, (f"a {table.format} table its {table.node.op_type} reads through a Cast "
                      f"({', '.join(table.views)}): left as it is")
    if "Reshape" in views:
        return None, (f"read through a Reshape that is not the table's own shape ({', '.join(views)}): left as it is "
                      "(a rewrite would have to undo it)")
    if relation == "shared" and not pair.via_transpose and "View" in head.views and (
            table.node.op_type == "Gather" or "View" in table.views):
        return None, None  # already read through a run-time view: one table in memory
    return "view", None


def _in_branches(path):
    """Whether a graph path (reading.graph_paths) runs through If branches only, each a graph run once as a whole
    (a Loop or Scan body runs once per iteration: a proof would have to follow its state)."""
    return all(step.endswith((".then_branch", ".else_branch")) for step in path.split("/")[1:])
