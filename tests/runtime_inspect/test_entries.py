"""What inspect knows, as types built by hand: TableEntry and HeadEntry (runtime.model.graph.entries) as the walker
must find them in a small graph written here, the relations a hand-built pair gives, and a Findings built by hand
rendered as --json renders it."""
import dataclasses
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from runtime.inspect.report.file import as_json
from runtime.model.findings.relations import relate
from runtime.model.found import Findings, static_findings
from runtime.model.graph.entries import HeadEntry, TableEntry
from runtime.model.graph.walk import find_tables_and_heads, lookup_ids
from runtime.model.read.model import load

V, W = 12, 4


def _model(tmp_path, head_values):
    """ids -> Gather(table) -> hidden -> MatMul(hidden, Transpose(head)) -> logits: a lookup of `table` and a head
    reading `head_values` stored [vocab, width] (the table itself where None: tied)."""
    table = np.arange(V * W, dtype=np.float32).reshape(V, W) / 7
    inits = [numpy_helper.from_array(table, "table")]
    head = "table"
    if head_values is not None:
        inits.append(numpy_helper.from_array(head_values, "head"))
        head = "head"
    nodes = [helper.make_node("Gather", ["table", "ids"], ["hidden"], name="lookup"),
             helper.make_node("Transpose", [head], ["head_t"], name="flip", perm=[1, 0]),
             helper.make_node("MatMul", ["hidden", "head_t"], ["logits"], name="score")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", V])], inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return load(str(path)), table


def _node(model, name):
    return next(n for n in model.proto.graph.node if n.name == name)


def _by_hand(model, role, initializer, node, flips, views, **more):
    """The entry the walker must find, every field written here from the graph above, none read from the walker."""
    kind = TableEntry if role == "table" else HeadEntry
    producer = {o: n for n in model.proto.graph.node for o in n.output}
    consumers = {}
    for n in model.proto.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    return kind(initializer=initializer, node=_node(model, node), flips=flips, views=views, stored_dims=(V, W),
                vocab=V, width=W, format="float32", scales=None, bytes=V * W * 4, quant=None, graph="main",
                body=model.proto.graph, producer=producer, consumers=consumers, **more)


def _fields(entry):
    """An entry's fields as values to compare: the maps by what they map, the node and body by name."""
    values = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    values["node"], values["body"] = entry.node.name, entry.body.name
    values["producer"] = {k: n.name for k, n in entry.producer.items()}
    values["consumers"] = {k: sorted(n.name for n in ns) for k, ns in entry.consumers.items()}
    return values


def test_the_walker_finds_the_entries_written_by_hand(tmp_path):
    model, _ = _model(tmp_path, None)
    tables, heads = find_tables_and_heads(model)
    table = _by_hand(model, "table", "table", "lookup", 0, ())
    head = _by_hand(model, "head", "table", "score", 1, ("Transpose",), as_table=True, scores="logits")
    assert [_fields(t) for t in tables] == [_fields(table)]
    assert [_fields(h) for h in heads] == [_fields(head)]
    assert (table.rows_are_tokens, head.rows_are_tokens, lookup_ids(table)) == (True, True, "ids")
    with pytest.raises(dataclasses.FrozenInstanceError):  # made once, where it is found
        tables[0].vocab = V + 1


@pytest.mark.parametrize("head_values, relation, wasted", [
    (None, "shared", 0),
    ("copy", "duplicate", V * W * 4),
    ("other", "distinct", 0),
])
def test_a_pair_of_hand_built_entries_relates_by_its_values(tmp_path, head_values, relation, wasted):
    table_values = np.arange(V * W, dtype=np.float32).reshape(V, W) / 7
    values = {None: None, "copy": table_values.copy(), "other": table_values + np.float32(1)}[head_values]
    model, _ = _model(tmp_path, values)
    table = _by_hand(model, "table", "table", "lookup", 0, ())
    head = _by_hand(model, "head", "table" if values is None else "head", "score", 1, ("Transpose",),
                    as_table=True, scores="logits")
    (pair,) = relate(model, [table], [head])
    assert (pair.table, pair.head, pair.relation, pair.wasted_bytes) == (table.initializer, head.initializer,
                                                                        relation, wasted)
    assert pair.table_entry is table and pair.head_entry is head


def test_a_findings_built_by_hand_is_what_json_prints(tmp_path):
    model, _ = _model(tmp_path, None)
    table = _by_hand(model, "table", "table", "lookup", 0, ())
    head = _by_hand(model, "head", "table", "score", 1, ("Transpose",), as_table=True, scores="logits")
    pairs = relate(model, [table], [head])
    copies = [{"name": "made", "bytes": 16, "shape": [2, 2]}]
    found = Findings(model, [table], [head], pairs, [], runtime_copies=copies, onnxruntime="9.9.9")
    document = json.loads(json.dumps(as_json(found, "m.onnx", verdict=False)))
    assert (document["model"], document["onnxruntime"], document["runtime_copies"]) == ("m.onnx", "9.9.9", copies)
    assert document["file_bytes"] == (tmp_path / "m.onnx").stat().st_size
    assert [(i["name"], i["shape"], i["bytes"]) for i in document["initializers"]] == [("table", [V, W], V * W * 4)]
    assert [(p["table"], p["head"], p["relation"]) for p in document["pairs"]] == [("table", "table", "shared")]
    assert (document["prefill"], document["prepacked_unrecorded"], document["branch_weights"]) == ([], None, [])
    assert found.rows == {"ids": V}
    static = static_findings(model)  # the files alone: what nothing ran is None or empty
    assert (static.runtime_copies, static.onnxruntime, static.optimized, static.prepacked) == (None, None, None, [])
