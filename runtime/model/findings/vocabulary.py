"""The vocabulary entries: one per table a lookup reads, with its size, tie, share and the copies a session holds."""
from runtime.model.findings import shares
from runtime.model.findings.copies import widened_others
from runtime.resident import scoped


def copy_key(copy):
    """A runtime copy's key among the optimized model's initializers (runtime.resident.scoped)."""
    return scoped(copy["name"], copy.get("graph"))


SMALL_COPY = 4096  # runtime copies under this many bytes (folded shape constants) are summarised in one line


def vocabulary(model, tables, heads, pairs, copies, held, version):
    """One entry per table a lookup reads: size, format, bytes, tie, and the copies a session holds.

    `held(names, table_bytes, other_bytes)` gives the `in_memory` entry of the tensors `names` (the table, a
    duplicate of it, what onnxruntime folds from them); `tables_in_memory` is its count under the defaults;
    `version` is the onnxruntime whose behaviour the counts describe (the isolated child's)."""
    params, counted = shares.parameters(model, tables, heads, pairs)
    total_bytes = sum(t.nbytes for t in model.tensors.values())
    entries = []
    by_table = {}
    for p in pairs:
        by_table.setdefault(p.table, []).append(p)
    for table in tables:
        mine = by_table.get(table.initializer, [])
        tie = next((p for p in mine if p.relation == "shared"), None) or next(
            (p for p in mine if p.relation in ("duplicate", "transposed_duplicate")), None)
        stored = {table.initializer} | ({tie.head} if tie else set())
        producer, consumers = table.producer, table.consumers  # its own scope's (a body's sees outer ones)
        scale, is_sqrt = shares.row_scale(model, table, producer, consumers)
        quantized_head = next((p for p in mine if p.relation == "quantized_copy"), None)
        folded = [copy_key(c) for c in copies if c.get("copy_of") in stored and c.get("view") != "prepacked"]
        stored_bytes = sum(model.tensors[n].nbytes for n in stored)
        others = total_bytes - stored_bytes - (table.bytes - model.tensors[table.initializer].nbytes)  # the
        # table's scales are its bytes too; the other weights as the session holds them (widened where it widens)
        memory = held(sorted(stored) + folded, table.bytes, others + widened_others(model, copies, stored))
        entries.append({"table": table.initializer, "graph": table.graph,
                        "vocab_size": table.vocab, "width": table.width,
                        "format": table.format, "bytes": table.bytes, "tied": tie is not None,
                        "head": tie.head if tie else None, "tie_relation": tie.relation if tie else None,
                        "tables_in_memory": memory["defaults"]["copies"],
                        "quantized_head": quantized_head and {"head": quantized_head.head,
                                                              "max_error_in_scales": quantized_head.max_error_in_scales,
                                                              "wasted_bytes": quantized_head.wasted_bytes},
                        "in_memory": memory,
                        "parameter_share": round(table.vocab * table.width / params, 4) if params else None,
                        "parameters_counted": params, "parameters_what": counted,
                        "row_scale": scale, "row_scale_is_sqrt_width": is_sqrt,
                        "kind": shares.kind(model, table, producer),
                        "padded_width": table.padded_width,
                        "byte_share": round(table.bytes / total_bytes, 4) if total_bytes else None,
                        "onnxruntime": version})  # whose folding and prepacking the counts describe
    return entries
