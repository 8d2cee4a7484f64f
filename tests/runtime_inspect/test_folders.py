"""runtime.inspect on subgraphs and folders (issue 30): a merged decoder's If branches read the table as an outer-scope
value; the files a client loads together are chosen by the folder's layout and related across files; a config
whose tie_word_embeddings the graph contradicts is a finding."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from runtime.model.read.layout import client_files
from runtime.model.read.model import graph_paths
from tests.helpers import FIXTURES, FOLDERS, findings, run_inspect, unwrapped

V, D = 1000, 64  # a table large enough that onnxruntime folds and prepacks copies of it
TABLE = np.random.default_rng(0).standard_normal((V, D)).astype(np.float32)
OTHER = np.random.default_rng(1).standard_normal((V, D)).astype(np.float32)


def decoder_nodes(prefix, mix, head_source="table"):
    """A decoder step: rows of `table`, a nonlinearity, and a head reading `head_source` through a Transpose."""
    return [helper.make_node("Gather", ["table", "ids"], [f"{prefix}x"], name=f"{prefix}gather"),
            helper.make_node(mix, [f"{prefix}x"], [f"{prefix}h"], name=f"{prefix}mix"),
            helper.make_node("Transpose", [head_source], [f"{prefix}t"], perm=[1, 0], name=f"{prefix}transpose"),
            helper.make_node("MatMul", [f"{prefix}h", f"{prefix}t"], [f"{prefix}logits"], name=f"{prefix}head")]


def logits_info(name):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", "s", V])


def model(nodes, inputs, outputs, initializers):
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in initializers.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    onnx.checker.check_model(m, full_check=True)
    return m


IDS = helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])


def merged_decoder(head=TABLE):
    """Optimum's merged layout: an If on use_cache_branch whose two branches each read the table from outside."""
    branches = {f"{side}_branch": helper.make_graph(decoder_nodes(f"{side}_", mix, "head" if head is not TABLE else
                                                                  "table"), side, [], [logits_info(f"{side}_logits")])
                for side, mix in (("then", "Tanh"), ("else", "Sigmoid"))}
    initializers = {"table": TABLE} if head is TABLE else {"table": TABLE, "head": head}
    return model([helper.make_node("If", ["use_cache_branch"], ["logits"], name="optimum::if", **branches)],
                 [IDS, helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1])],
                 [logits_info("logits")], initializers)


def plain_decoder():
    return model(decoder_nodes("", "Tanh"), [IDS], [logits_info("logits")], {"table": TABLE})


def encoder():
    return model([helper.make_node("Gather", ["embed_tokens.weight", "ids"], ["x"], name="encoder_gather"),
                  helper.make_node("Tanh", ["x"], ["last_hidden_state"])], [IDS],
                 [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["b", "s", D])],
                 {"embed_tokens.weight": TABLE})


def folder(tmp_path, config=None, head=TABLE):
    where = tmp_path / "export"
    where.mkdir()
    onnx.save(encoder(), where / "encoder_model.onnx")
    onnx.save(merged_decoder(head), where / "decoder_model_merged.onnx")
    if config is not None:
        (where / "config.json").write_text(json.dumps(config))
    return where


# --- subgraphs ---------------------------------------------------------------------------------------------------

def test_a_merged_decoder_reads_its_table_inside_both_branches(tmp_path):
    # failed on the main before issue 30: "vocabulary: no table (no Gather ... reads rows from an initializer)"
    onnx.save(merged_decoder(), tmp_path / "merged.onnx")
    data = findings(tmp_path / "merged.onnx")
    (entry,) = data["vocabulary"]
    assert (entry["table"], entry["tied"], entry["graph"]) == ("table", True, "main/optimum::if.else_branch")
    assert sorted(p["head_graph"] for p in data["pairs"]) == ["main/optimum::if.else_branch",
                                                             "main/optimum::if.then_branch"]
    # onnxruntime folds each branch's Transpose into an initializer of that branch: two transposed copies
    folded = sorted((c["name"], c["graph"]) for c in data["runtime_copies"] if c.get("view") == "transposed")
    assert folded == [("else_t", "main/optimum::if.else_branch"), ("then_t", "main/optimum::if.then_branch")]


def test_a_merged_decoder_holds_more_tables_than_one_without_the_if(tmp_path):
    """The issue's measurement: about three tables under the defaults against two for the same graph, unmerged."""
    onnx.save(merged_decoder(), tmp_path / "merged.onnx")
    onnx.save(plain_decoder(), tmp_path / "plain.onnx")
    merged, plain = (findings(tmp_path / f"{n}.onnx")["vocabulary"][0]["tables_in_memory"] for n in ("merged", "plain"))
    assert plain == 2 and merged == 3


# --- choosing the files --------------------------------------------------------------------------------------------

def touch(where, *names):
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(where, name)), exist_ok=True)
        open(os.path.join(where, name), "wb").close()


@pytest.mark.parametrize("names, files, rule", [
    (["encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx", "decoder_model_merged.onnx"],
     ["encoder_model.onnx", "decoder_model_merged.onnx"], "the encoder and the merged decoder"),
    (["encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"],
     ["encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"], "split decoder pair"),
    (["embed_tokens.onnx", "decoder_model.onnx"], ["embed_tokens.onnx", "decoder_model.onnx"], "split decoder pair"),
    (["onnx/embed_tokens_q4.onnx", "onnx/decoder_model_merged_q4.onnx", "onnx/vision_encoder_q4.onnx",
      "onnx/embed_tokens.onnx", "onnx/decoder_model_merged.onnx", "onnx/vision_encoder.onnx"],
     ["onnx/embed_tokens.onnx", "onnx/vision_encoder.onnx", "onnx/decoder_model_merged.onnx"], "transformers.js"),
    (["onnx/embed_tokens_fp16.onnx", "onnx/decoder_model_merged_fp16.onnx"],
     ["onnx/embed_tokens_fp16.onnx", "onnx/decoder_model_merged_fp16.onnx"], "suffix '_fp16'"),
    (["b.onnx", "a.onnx", "notes.txt"], ["a.onnx", "b.onnx"], "every .onnx file"),
])
def test_the_files_a_client_loads_together(names, files, rule, tmp_path):
    touch(tmp_path, *names)
    chosen, why = client_files(str(tmp_path))
    assert chosen == files and rule in why


def test_genai_config_names_the_files(tmp_path):
    touch(tmp_path, "model.onnx", "embeds.onnx", "other.onnx")
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "model.onnx"},
                                                                      "embedding": {"filename": "embeds.onnx"}}}))
    assert client_files(str(tmp_path)) == (["model.onnx", "embeds.onnx"], "genai_config.json's model files")


def test_files_outside_the_folder_are_refused(tmp_path):
    touch(tmp_path, "export/a.onnx", "b.onnx")
    for names in (["../b.onnx"], ["missing.onnx"]):
        with pytest.raises(Exception, match="--files"):
            client_files(str(tmp_path / "export"), names)


# --- across the files ------------------------------------------------------------------------------------------------

def test_the_table_in_two_files_is_one_table_stored_twice(tmp_path):
    # failed on the main before issue 30: "...: not a regular file"
    data = findings(folder(tmp_path, {"tie_word_embeddings": True}))
    assert [f["path"] for f in data["files"]] == ["encoder_model.onnx", "decoder_model_merged.onnx"]
    (pair,) = data["across_files"]["pairs"]
    assert (pair["a"]["name"], pair["b"]["name"], pair["relation"], pair["wasted_bytes"]) == (
        "embed_tokens.weight", "table", "duplicate", TABLE.nbytes)
    (entry,) = data["across_files"]["vocabulary"]
    assert (entry["copies_on_disk"], entry["wasted_bytes"], entry["tied"]) == (2, TABLE.nbytes, True)
    assert sorted((r["file"], r["node"], r["role"]) for r in entry["readers"]) == [
        ("decoder_model_merged.onnx", "else_gather", "lookup"), ("decoder_model_merged.onnx", "else_head", "head"),
        ("decoder_model_merged.onnx", "then_head", "head"), ("encoder_model.onnx", "encoder_gather", "lookup")]
    # one process, both sessions: the encoder's table, and the decoder's three (file's own count)
    per_file = sum(f["vocabulary"][0]["tables_in_memory"] for f in data["files"])
    assert entry["in_memory"]["defaults"]["copies"] == per_file == 4
    assert entry["in_memory"]["defaults"]["resident_bytes"] > 0
    assert (entry["config_tie"], entry["tie_finding"]) == (True, None)


def test_check_exits_1_for_a_table_held_twice_and_0_once(tmp_path):
    where = folder(tmp_path)
    done = run_inspect(where, "--check")
    (entry,) = findings(where)["across_files"]["vocabulary"]
    last = done.stdout.splitlines()[-1]  # what a CI log shows: why it failed
    assert entry["copies_on_disk"] == 2
    assert done.returncode == 1 and last == f"--check: failed (1): {entry['table']} stored twice", last
    once = tmp_path / "once"
    once.mkdir()
    onnx.save(encoder(), once / "model.onnx")
    done = run_inspect(once / "model.onnx", "--check")
    assert done.returncode == 0, done.stderr
    assert run_inspect(once, "--check").returncode == 0


def test_a_config_that_says_untied_while_the_head_reads_the_table_is_a_wrong_tie(tmp_path):
    where = folder(tmp_path, {"tie_word_embeddings": False})
    (entry,) = findings(where)["across_files"]["vocabulary"]
    assert (entry["config_tie"], entry["tie_finding"]) == (False, "wrong_tie")
    done = run_inspect(where)
    first = done.stdout.splitlines()[0]  # the answer opens the report
    assert done.returncode == 0 and first.startswith(f"WRONG TIE {entry['table']}: config.json says "
                                                     "tie_word_embeddings false"), done.stdout


def test_a_config_that_says_tied_while_the_head_holds_other_values_is_a_lost_tie(tmp_path):
    where = folder(tmp_path, {"text_config": {"vocab_size": V}}, head=OTHER)  # absent: transformers' default, tied
    (entry,) = findings(where)["across_files"]["vocabulary"]
    assert (entry["config_tie"], entry["tied"], entry["tie_finding"]) == (True, False, "lost_tie")
    assert run_inspect(where).stdout.startswith(f"LOST TIE {entry['table']}: ")


def test_files_chooses_and_folder_only_options_are_refused_elsewhere(tmp_path):
    where = folder(tmp_path)
    data = findings(where, "--files", "encoder_model.onnx")
    assert [f["path"] for f in data["files"]] == ["encoder_model.onnx"] and data["rule"] == "--files"
    for args in ((where / "encoder_model.onnx", "--files", "x.onnx"),
                 (where / "encoder_model.onnx", "--check", "--retie", tmp_path / "o.onnx")):
        done = run_inspect(*args)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, args


# --- real exports (tests/fixtures/make_folder_fixtures.py) ----------------------------------------------------------

VOCAB, WIDTH = 256, 32  # every folder fixture's


def every_node(graph):
    """The graph's nodes and its If branches' (a merged decoder's Gather lies in them)."""
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.HasField("g"):
                yield from every_node(a.g)


def copies_of_the_table(folder, files):
    """{(file, initializer)} of every tensor in `files` holding the token table's values, as stored or transposed,
    found here with numpy: the first [VOCAB, WIDTH] float initializer read by a Gather is the table."""
    tensors = {f: {t.name: numpy_helper.to_array(t) for t in onnx.load(os.path.join(folder, f)).graph.initializer}
               for f in files}
    table = next(tensors[f][n.input[0]] for f in files for n in every_node(onnx.load(os.path.join(folder, f)).graph)
                 if n.op_type == "Gather" and tensors[f].get(n.input[0], np.empty(0)).shape == (VOCAB, WIDTH))
    same = lambda a: a.dtype == table.dtype and (
        (a.shape == table.shape and np.array_equal(a.view(np.uint32), table.view(np.uint32))) or
        (a.shape == table.shape[::-1] and np.array_equal(a.T.view(np.uint32), table.view(np.uint32))))
    return {(f, name) for f in files for name, a in tensors[f].items() if a.ndim == 2 and same(a)}


@pytest.mark.parametrize("name, files", [  # a merged and a split layout in the fast loop
    ("optimum_t5", ["encoder_model.onnx", "decoder_model_merged.onnx"]),
    pytest.param("optimum_bart", ["encoder_model.onnx", "decoder_model_merged.onnx"], marks=pytest.mark.slow),
    pytest.param("optimum_marian", ["encoder_model.onnx", "decoder_model_merged.onnx"], marks=pytest.mark.slow),
    pytest.param("optimum_m2m100", ["encoder_model.onnx", "decoder_model_merged.onnx"], marks=pytest.mark.slow),
    pytest.param("optimum_whisper", ["encoder_model.onnx", "decoder_model_merged.onnx"], marks=pytest.mark.slow),
    ("split_gpt2", ["embed_tokens.onnx", "decoder_model.onnx"]),
], ids=["optimum_t5", "optimum_bart", "optimum_marian", "optimum_m2m100", "optimum_whisper", "split_gpt2"])
def test_a_shipped_folder_holds_its_table_where_the_files_say(name, files):
    # failed on the main before issue 30: a folder was "not a regular file"
    folder = os.path.join(FOLDERS, name)
    data = findings(folder)
    assert [f["path"] for f in data["files"]] == files
    (entry,) = [v for v in data["across_files"]["vocabulary"] if v["kind"] == "token"]
    expected = copies_of_the_table(folder, files)
    assert {(s["file"], s["name"]) for s in entry["stored"]} == expected
    assert (entry["copies_on_disk"], entry["wasted_bytes"]) == (len(expected), (len(expected) - 1) * VOCAB * WIDTH * 4)
    assert entry["tied"] and (entry["config_tie"], entry["tie_finding"]) == (True, None)
    assert {r["role"] for r in entry["readers"]} == {"lookup", "head"}
    assert run_inspect(folder, "--check").returncode == 1  # held more than once: what --check is for


@pytest.mark.slow
@pytest.mark.parametrize("name, finding", [("wrong_tie_gpt2", "wrong_tie"), ("lost_tie_gpt2", "lost_tie")])
def test_the_two_config_mismatches(name, finding):
    folder = os.path.join(FOLDERS, name)
    config = json.load(open(os.path.join(folder, "config.json")))["tie_word_embeddings"]
    (entry,) = [v for v in findings(folder)["across_files"]["vocabulary"] if v["kind"] == "token"]
    assert (entry["config_tie"], entry["tie_finding"]) == (config, finding)
    done = run_inspect(folder, "--check")
    assert done.returncode == 1 and f"{finding.split('_')[0].upper()} TIE" in done.stdout


# --- retying inside If branches ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_retie_a_merged_decoder_reads_the_table_in_place_in_both_branches(tmp_path):
    # failed on the main before issue 30 (no table found); then "found and counted, not rewritten"
    onnx.save(merged_decoder(), tmp_path / "merged.onnx")
    out = tmp_path / "retied.onnx"
    done = run_inspect(tmp_path / "merged.onnx", "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert findings(out)["vocabulary"][0]["tables_in_memory"] == 1
    import onnxruntime as ort
    session = ort.InferenceSession(str(out))
    ids = np.array([[0, 5, V - 1]])
    for flag, mix in ((True, np.tanh), (False, lambda x: 1 / (1 + np.exp(-x)))):
        (logits,) = session.run(["logits"], {"ids": ids, "use_cache_branch": np.array([flag])})
        h = mix(TABLE[ids].astype(np.float64))  # each branch's own hidden, in float64
        exact = h @ TABLE.T.astype(np.float64)
        bound = D * 2.0**-24 / (1 - D * 2.0**-24) * (np.abs(h) @ np.abs(TABLE.T.astype(np.float64)))
        assert np.all(np.abs(logits - exact) <= 2 * bound + 2.0**-23 * np.abs(exact)), flag  # h rounded too


@pytest.mark.slow
@pytest.mark.parametrize("name", ["optimum_t5", "optimum_whisper", "optimum_gpt2_legacy_merged"])
def test_retie_a_real_merged_decoder_holds_one_table(name, tmp_path):
    source = os.path.join(FOLDERS, name, "decoder_model_merged.onnx")
    assert [v["tables_in_memory"] for v in findings(source)["vocabulary"] if v["vocab_size"] == VOCAB] == [2]
    out = tmp_path / "decoder_model_merged.onnx"
    done = run_inspect(source, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    tokens = [v for v in findings(out)["vocabulary"] if v["vocab_size"] == VOCAB]
    assert [v["tables_in_memory"] for v in tokens] == [1]
    stored = lambda path: sum(numpy_helper.to_array(t).nbytes for _, _, g in graph_paths(onnx.load(path).graph)
                              for t in g.initializer)
    assert stored(out) <= stored(source) - VOCAB * WIDTH * 4 + 4096  # the head's copy is gone (a few constants come)


WIDE = 1 << 15  # the branches' shared weights: [D, WIDE] and [WIDE, D], 8 MiB each, above the session's noise
W_IN = np.random.default_rng(2).standard_normal((D, WIDE)).astype(np.float32) / 8
W_OUT = np.random.default_rng(3).standard_normal((WIDE, D)).astype(np.float32) / 180


def shared_weight_decoder():
    """A merged decoder whose branches both read the table and two MatMul weights from the main graph, and show
    their hidden vector `h` (tanh of the rows through both weights) beside the logits."""
    def branch(side):
        nodes = [helper.make_node("Gather", ["table", "ids"], [f"{side}_x"]),
                 helper.make_node("MatMul", [f"{side}_x", "w_in"], [f"{side}_wide"]),
                 helper.make_node("Relu" if side == "then" else "Sigmoid", [f"{side}_wide"], [f"{side}_mixed"]),
                 helper.make_node("MatMul", [f"{side}_mixed", "w_out"], [f"{side}_back"]),
                 helper.make_node("Tanh", [f"{side}_back"], [f"{side}_h"]),
                 helper.make_node("Transpose", ["table"], [f"{side}_t"], perm=[1, 0]),
                 helper.make_node("MatMul", [f"{side}_h", f"{side}_t"], [f"{side}_logits"])]
        return helper.make_graph(nodes, side, [], [logits_info(f"{side}_logits"), helper.make_tensor_value_info(
            f"{side}_h", TensorProto.FLOAT, ["b", "s", D])])
    return model([helper.make_node("If", ["use_cache_branch"], ["logits", "h"], name="optimum::if",
                                   then_branch=branch("then"), else_branch=branch("else"))],
                 [IDS, helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1])],
                 [logits_info("logits"), helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", "s", D])],
                 {"table": TABLE, "w_in": W_IN, "w_out": W_OUT})


GROWTH = """
import sys, numpy as np, onnxruntime as ort
def anonymous():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("Anonymous:"))
ort.InferenceSession(sys.argv[2]).run(None, {"ids": np.zeros((1, 1), np.int64), "use_cache_branch": np.ones(1, bool)})
before = anonymous()
session = ort.InferenceSession(sys.argv[1])  # onnxruntime's defaults
for flag in (True, False):
    session.run(None, {"ids": np.array([[0, 5, 9, 7]]), "use_cache_branch": np.array([flag])})
print(anonymous() - before)
"""


def anonymous_growth(path, warm):
    """The anonymous memory a fresh process grows by, opening `path` under onnxruntime's defaults and running both
    branches once (after a session on `warm` has loaded onnxruntime's code and state)."""
    done = subprocess.run([sys.executable, "-c", GROWTH, str(path), str(warm)], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


def retied(source, out):
    """(what `inspect SOURCE --retie OUT` printed, OUT as onnx reads it), the command having succeeded."""
    done = run_inspect(source, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, onnx.load(out)


@pytest.mark.slow
def test_retie_reads_the_weights_a_merged_decoders_branches_share_in_place(tmp_path):
    onnx.save(shared_weight_decoder(), tmp_path / "merged.onnx")
    onnx.save(merged_decoder(), tmp_path / "warm.onnx")
    out = tmp_path / "retied.onnx"
    printed, model = retied(tmp_path / "merged.onnx", out)
    printed = " ".join(unwrapped(printed))  # each line as one, however wrapped
    assert "the 2 weights its branches share (16.0 MiB" in printed
    assert "every other output bit for bit with the export's run under session.disable_prepacking=1" in printed
    stored = {t.name for t in model.graph.initializer}
    assert not [n.name for _, _, g in graph_paths(model.graph) for n in g.node
                if n.op_type in ("MatMul", "Gemm") and n.input[1] in stored]  # each reads a run-time view
    # under the defaults each branch packed its own copy of both weights: one copy (16 MiB) fewer now, and the
    # table's transposed copies (2 x 256 KiB) gone too
    shared = W_IN.nbytes + W_OUT.nbytes
    export, now = (anonymous_growth(p, tmp_path / "warm.onnx") for p in (tmp_path / "merged.onnx", out))
    assert export - now >= 0.9 * shared, (export, now)
    assert export >= 1.9 * shared  # the export held both copies (the premise)
    import onnxruntime as ort
    unpacked = ort.SessionOptions()
    unpacked.add_session_config_entry("session.disable_prepacking", "1")
    export, now = ort.InferenceSession(str(tmp_path / "merged.onnx"), unpacked), ort.InferenceSession(str(out))
    ids = np.array([[0, 5, V - 1, 7]])
    for flag in (True, False):
        feeds = {"ids": ids, "use_cache_branch": np.array([flag])}
        (_, h0), (logits, h) = export.run(["logits", "h"], feeds), now.run(["logits", "h"], feeds)
        assert np.array_equal(h.view(np.uint32), h0.view(np.uint32)), flag  # the export's bits, prepacking off
        exact = h.astype(np.float64) @ TABLE.T.astype(np.float64)
        bound = D * 2.0**-24 / (1 - D * 2.0**-24) * (np.abs(h.astype(np.float64)) @ np.abs(TABLE.T.astype(np.float64)))
        assert np.all(np.abs(logits - exact) <= bound), flag


@pytest.mark.slow
def test_weights_read_in_place_that_do_not_prove_are_put_back(tmp_path):
    # each branch also multiplies by a Constant node's weight, which onnxruntime still prepacks: the export run with
    # prepacking off then differs from the retied file in more than the views, so the proof against it fails; the
    # retie puts the shared weights back as they were and proves the table's retie alone
    m = shared_weight_decoder()
    extra = np.random.default_rng(4).standard_normal((D, D)).astype(np.float32)
    (node,) = m.graph.node
    for a in node.attribute:
        side = a.g.name
        a.g.node.extend([helper.make_node("Constant", [], [f"{side}_c"], value=numpy_helper.from_array(extra)),
                         helper.make_node("MatMul", [f"{side}_x", f"{side}_c"], [f"{side}_extra"])])
        a.g.output.append(helper.make_tensor_value_info(f"{side}_extra", TensorProto.FLOAT, ["b", "s", D]))
    node.output.append("extra")
    m.graph.output.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, ["b", "s", D]))
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, tmp_path / "merged.onnx")
    out = tmp_path / "retied.onnx"
    printed, model = retied(tmp_path / "merged.onnx", out)
    printed = " ".join(unwrapped(printed))
    assert "the weights its branches share are left as they are (read in place: " in printed
    assert "table is now the one copy (2 heads now a Gemm on its run-time view); proven" in printed
    readers = [n.input[1] for _, _, g in graph_paths(model.graph) for n in g.node if n.op_type == "MatMul"]
    assert readers.count("w_in") == readers.count("w_out") == 2  # as exported: each branch reads them directly
    assert not [n.name for _, _, g in graph_paths(model.graph) for n in g.node if n.name.startswith("retie_weight")]
    assert findings(out)["vocabulary"][0]["tables_in_memory"] == 1


def test_inspect_names_the_weights_a_merged_decoders_branches_both_read():
    source = os.path.join(FOLDERS, "optimum_t5", "decoder_model_merged.onnx")
    proto = onnx.load(source)
    main = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    (node,) = [n for n in proto.graph.node if n.op_type == "If"]
    read = [{n.input[1] for n in a.g.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in main
             and main[n.input[1]].dtype == np.float32 and main[n.input[1]].ndim == 2} for a in node.attribute]
    both = read[0] & read[1]
    assert len(both) >= 8  # the decoder's attention and feed-forward weights, and the head's copy of the table
    found = findings(source)["branch_weights"]
    assert {b["name"] for b in found} == both
    assert sum(b["bytes"] for b in found) == sum(main[n].nbytes for n in both)
    assert all(len(b["graphs"]) == 2 for b in found)


def test_weights_read_in_only_one_graph_are_left_as_they_are():
    import tempfile

    from runtime.model.read.model import load
    from runtime.inspect.retie import branches
    with tempfile.TemporaryDirectory() as where:
        onnx.save(plain_decoder(), os.path.join(where, "plain.onnx"))
        onnx.save(shared_weight_decoder(), os.path.join(where, "shared.onnx"))
        plain, shared = load(os.path.join(where, "plain.onnx")), load(os.path.join(where, "shared.onnx"))
    none, both = branches.shared_weights(plain), branches.shared_weights(shared)
    assert none == {} and branches.why_not(plain, [], none) == "no MatMul weight is read in two graphs"
    branches_of = ["main/optimum::if.else_branch", "main/optimum::if.then_branch"]
    assert both == {name: branches_of for name in ("w_in", "w_out")}
    assert branches.why_not(shared, [{"kernel": "MatMul"}], both) is None
    assert branches.why_not(shared, [{"kernel": "Conv"}], both) == "its Conv kernels prepack too"


# --- retying a folder ---------------------------------------------------------------------------------------------------

def external(path, name):
    """(location, offset, length) a model file names for initializer `name`, read with onnx."""
    (tensor,) = [t for t in onnx.load(path, load_external_data=False).graph.initializer if t.name == name]
    info = {e.key: e.value for e in tensor.external_data}
    return info["location"], int(info.get("offset", 0)), int(info["length"])


@pytest.mark.slow
def test_retie_a_folder_stores_the_table_once_for_every_file(tmp_path):
    # failed on the main before issue 30: a folder was "not a regular file"
    source = os.path.join(FOLDERS, "optimum_t5")
    out = tmp_path / "retied"
    done = run_inspect(source, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(out)) == ["config.json", "decoder_model_merged.onnx", "encoder_model.onnx",
                                       "generation_config.json", "model.data"]
    # both files name the same bytes of the one data file, and those bytes are the export's table
    encoder = external(out / "encoder_model.onnx", "embed_tokens.weight")
    decoder = external(out / "decoder_model_merged.onnx", "shared.weight_merged_0")
    assert encoder == decoder and encoder[0] == "model.data" and encoder[1] % 4096 == 0
    table = numpy_helper.to_array(next(t for t in onnx.load(os.path.join(source, "encoder_model.onnx")).graph.initializer
                                       if t.name == "embed_tokens.weight"))
    stored = np.fromfile(out / "model.data", np.uint8, count=encoder[2], offset=encoder[1])
    assert np.array_equal(stored, table.view(np.uint8).reshape(-1))
    # nothing else in the data file is the table again, as stored or transposed
    data = np.fromfile(out / "model.data", np.uint8)
    assert data.tobytes().count(table.tobytes()) == 1 and table.T.copy().tobytes() not in data.tobytes()
    (entry,) = [v for v in findings(out)["across_files"]["vocabulary"] if v["kind"] == "token"]
    assert (entry["copies_on_disk"], entry["in_memory"]["defaults"]["copies"]) == (1, 1)
    # the encoder, which no retie changes, gives the same bits
    import onnxruntime as ort
    ids = {"input_ids": np.array([[3, 17, 200, 1]]), "attention_mask": np.ones((1, 4), np.int64)}
    before, after = (ort.InferenceSession(str(p)).run(None, ids)[0] for p in
                     (os.path.join(source, "encoder_model.onnx"), out / "encoder_model.onnx"))
    assert np.array_equal(before.view(np.uint32), after.view(np.uint32))


def test_retie_a_folder_refuses_an_out_that_exists_or_lies_inside(tmp_path):
    where = folder(tmp_path)
    (tmp_path / "there").mkdir()
    for out in (tmp_path / "there", where / "inside"):
        done = run_inspect(where, "--retie", out)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, out
    assert sorted(os.listdir(tmp_path)) == ["export", "there"] and not os.listdir(tmp_path / "there")


def test_a_folder_whose_proof_fails_writes_nothing(tmp_path, monkeypatch, capsys):
    from runtime.inspect import cli
    from runtime.inspect.retie import rewrite
    real = rewrite.rewrite

    def off_by_a_thousandth(model, pairs, *flags):  # the rewritten head reads a table one value off
        answer = real(model, pairs, *flags)
        graph = model.proto.graph
        gemms = [n for _, _, g in graph_paths(graph) for n in g.node if n.op_type == "Gemm"]
        wrong = TABLE.copy()
        wrong[3, 3] *= 1.001
        graph.initializer.append(numpy_helper.from_array(wrong, "almost"))
        for g in [a.g for n in graph.node for a in n.attribute if a.HasField("g")]:
            for n in g.node:
                if n.op_type == "Reshape" and n.input[0] == "table" and any(n.output[0] in m.input for m in gemms):
                    n.input[0] = "almost"
        return answer
    monkeypatch.setattr(rewrite, "rewrite", off_by_a_thousandth)
    out = tmp_path / "out"
    status = cli.main([str(folder(tmp_path)), "--retie", str(out)], supervised=False)
    printed = capsys.readouterr().out
    assert status == 1 and "not proven, nothing written" in printed and not out.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".saving")]


def test_static_answers_from_the_files_alone(tmp_path):
    source = os.path.join(FOLDERS, "optimum_t5")
    measured, static = findings(source), findings(source, "--static")
    assert static["onnxruntime"] is None and measured["onnxruntime"]
    assert static["across_files"]["pairs"] == measured["across_files"]["pairs"]
    for f in static["files"]:
        assert f["runtime_copies"] is None and all(v["tables_in_memory"] is None for v in f["vocabulary"])
    assert [f["pairs"] for f in static["files"]] == [f["pairs"] for f in measured["files"]]
    assert run_inspect(source, "--static", "--check").returncode == 1  # stored three times: seen on disk alone
    done = run_inspect(source, "--static", "--retie", tmp_path / "out")
    assert done.returncode == 2 and "without --static" in done.stderr and not (tmp_path / "out").exists()


def test_a_file_linked_from_outside_the_folder_is_refused(tmp_path):
    onnx.save(encoder(), tmp_path / "elsewhere.onnx")
    where = tmp_path / "export"
    where.mkdir()
    os.symlink(tmp_path / "elsewhere.onnx", where / "decoder_model_merged.onnx")
    (where / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "../elsewhere.onnx"}}}))
    for folder_path in (where,):
        done = run_inspect(folder_path)
        assert done.returncode == 2 and "not inside" in done.stderr and done.stderr.count("\n") == 1
    os.remove(where / "genai_config.json")
    done = run_inspect(where)
    assert done.returncode == 2 and "not inside" in done.stderr


def with_head_input(path, out):
    """A copy of the decoder at `path` that also outputs what its last MatMul (the head) multiplies: the hidden."""
    m = onnx.load(path)
    head = [n for n in m.graph.node if n.op_type == "MatMul"][-1]
    m.graph.output.append(helper.make_tensor_value_info(head.input[0], TensorProto.FLOAT, None))
    onnx.save(m, out)
    return head.input[0]


@pytest.mark.slow
def test_retie_a_split_folder_points_the_decoders_head_at_the_lookups_table(tmp_path):
    # said "left as it is (a head is not yet pointed at another file's table)" before
    import onnxruntime as ort
    source, out = os.path.join(FOLDERS, "split_gpt2"), tmp_path / "retied"
    done = run_inspect(source, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(out)) == ["config.json", "decoder_model.onnx", "embed_tokens.onnx",
                                       "generation_config.json", "model.data"]
    lookup = external(out / "embed_tokens.onnx", "transformer.wte.weight")
    head = external(out / "decoder_model.onnx", "transformer.wte.weight")
    assert lookup == head and lookup[1] % 4096 == 0  # the head reads the lookup's bytes of the one data file
    table = numpy_helper.to_array(onnx.load(os.path.join(source, "embed_tokens.onnx")).graph.initializer[0])
    data = np.fromfile(out / "model.data", np.uint8).tobytes()
    assert data.count(table.tobytes()) == 1 and table.T.copy().tobytes() not in data
    (entry,) = [v for v in findings(out)["across_files"]["vocabulary"] if v["kind"] == "token"]
    assert (entry["copies_on_disk"], entry["in_memory"]["defaults"]["copies"]) == (1, 1)
    # the pair as a client runs it: the lookup's rows into the decoder, whose logits stay within the float32 bound
    # of the exact product of the hidden (read from the original) and the table
    hidden_name = with_head_input(os.path.join(source, "decoder_model.onnx"), tmp_path / "seen.onnx")
    ids = np.array([[3, 17, 200, 1, 255]])
    embeds = ort.InferenceSession(str(out / "embed_tokens.onnx")).run(None, {"input_ids": ids})[0]
    assert np.array_equal(embeds, table[ids])
    feeds = {"inputs_embeds": embeds, "attention_mask": np.ones((1, 5), np.int64),
             "position_ids": np.arange(5)[None]}
    logits, hidden = ort.InferenceSession(str(tmp_path / "seen.onnx")).run(["logits", hidden_name], feeds)
    (retied,) = ort.InferenceSession(str(out / "decoder_model.onnx")).run(["logits"], feeds)
    h = hidden.astype(np.float64)
    exact = h @ table.T.astype(np.float64)
    bound = WIDTH * 2.0**-24 / (1 - WIDTH * 2.0**-24) * (np.abs(h) @ np.abs(table.T.astype(np.float64)))
    for scores in (logits, retied):
        assert np.all(np.abs(scores - exact) <= bound)
    assert not np.array_equal(logits, np.zeros_like(logits))


@pytest.mark.slow
def test_retie_a_genai_folder_keeps_its_config_naming_the_decoder(tmp_path):
    out = tmp_path / "out"
    done = run_inspect(os.path.join(FIXTURES, "genai_fp32"), "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(out)) == ["genai_config.json", "model.data", "model.onnx"]
    assert json.load(open(out / "genai_config.json"))["model"]["decoder"]["filename"] == "model.onnx"
    (entry,) = [v for v in findings(out)["across_files"]["vocabulary"] if v["kind"] == "token"]
    assert entry["in_memory"]["defaults"]["copies"] == 1


def test_the_proof_feeds_a_decoder_what_its_encoder_makes(tmp_path):
    # the decoder was proven on random encoder_hidden_states before
    import onnxruntime as ort

    from runtime.inspect.examine_folder import inspect_folder
    from runtime.inspect.retie.folder import upstream
    from runtime.inspect.sandbox import isolated
    from runtime.feeds import shaped_feeds
    from runtime.inspect.sandbox.proof import _fed_from
    source = os.path.join(FOLDERS, "optimum_t5")
    result = inspect_folder(source, str(tmp_path), isolated.Limits(), static=True)
    (fed,) = upstream(result["items"])["decoder_model_merged.onnx"]
    assert (fed.input, fed.output) == ("encoder_hidden_states", "last_hidden_state")
    assert upstream(result["items"])["encoder_model.onnx"] == []
    decoder = result["items"][1]
    feeds = shaped_feeds(decoder["model"].proto, decoder["info"].rows, decoder["info"].shape, 3)
    kept = {}
    made = _fed_from(feeds, fed, kept)
    length = feeds["encoder_hidden_states"].shape[1]
    assert not np.array_equal(made["encoder_hidden_states"], feeds["encoder_hidden_states"])
    # what the encoder gives, run here on the encoder's own proof feeds of that length
    encoder = result["items"][0]
    rerun = ort.InferenceSession(os.path.join(source, "encoder_model.onnx")).run(
        ["last_hidden_state"], shaped_feeds(encoder["model"].proto, encoder["info"].rows, encoder["info"].shape,
                                            length))[0]
    assert np.array_equal(made["encoder_hidden_states"].view(np.uint32), rerun.view(np.uint32))
    # the other branch's feeds take the same value from the same session: the encoder runs once a length
    again = _fed_from(dict(feeds), fed, kept)
    assert again["encoder_hidden_states"] is made["encoder_hidden_states"] and len(kept) == 2
    assert {k: v.tobytes() for k, v in made.items() if k != "encoder_hidden_states"} == \
        {k: v.tobytes() for k, v in feeds.items() if k != "encoder_hidden_states"}


def split_with_quantized_head(tmp_path, codes_of):
    """A split pair: embed_tokens.onnx looks rows of TABLE up; decoder_model.onnx scores with an int8 head,
    DequantizeLinear(codes_of(TABLE), one scale a row) read through a Transpose."""
    where = tmp_path / "split"
    where.mkdir(parents=True)
    onnx.save(model([helper.make_node("Gather", ["embed_tokens.weight", "input_ids"], ["inputs_embeds"])],
                    [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                    [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, ["b", "s", D])],
                    {"embed_tokens.weight": TABLE}), where / "embed_tokens.onnx")
    scale = (np.abs(TABLE).max(axis=1) / 127).astype(np.float32)
    codes = codes_of(TABLE, scale)
    onnx.save(model([helper.make_node("Tanh", ["inputs_embeds"], ["h"]),
                     helper.make_node("DequantizeLinear", ["head_codes", "head_scale"], ["head"], axis=0),
                     helper.make_node("Transpose", ["head"], ["head_t"], perm=[1, 0]),
                     helper.make_node("MatMul", ["h", "head_t"], ["logits"], name="lm_head")],
                    [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, ["b", "s", D])],
                    [logits_info("logits")], {"head_codes": codes, "head_scale": scale}), where / "decoder_model.onnx")
    return where, codes, scale


@pytest.mark.slow
def test_a_quantized_head_in_another_file_is_a_quantized_copy_of_the_table(tmp_path):
    # two files' codes and floats were not related across files before
    rounded = lambda t, s: np.clip(np.round(t / s[:, None]), -127, 127).astype(np.int8)
    where, codes, scale = split_with_quantized_head(tmp_path, rounded)
    data = findings(where)
    (pair,) = [p for p in data["across_files"]["pairs"] if p["relation"] != "shared"]
    assert pair["relation"] == "quantized_copy"
    assert {pair["a"]["name"], pair["b"]["name"]} == {"embed_tokens.weight", "head_codes"}
    (entry,) = [v for v in data["across_files"]["vocabulary"] if v["kind"] == "token"]
    assert entry["copies_on_disk"] == 2
    assert np.max(np.abs(codes * scale[:, None] - TABLE) / scale[:, None]) <= 0.5 + 1e-6  # what makes it a copy
    # another table's rows quantized the same way are no copy of this one
    other, _, _ = split_with_quantized_head(tmp_path / "other", lambda t, s: rounded(OTHER, s))
    assert not [p for p in findings(other)["across_files"]["pairs"] if p["relation"] != "shared"]
    done = run_inspect(where, "--retie", tmp_path / "out")
    assert done.returncode == 0 and "left as it is (an int8 copy" in done.stdout and not (tmp_path / "out").exists()


def test_read_in_place_anchors_on_an_input_and_undoes_exactly(tmp_path, monkeypatch):
    from runtime.model.read.model import load
    from runtime.inspect.retie import branches
    onnx.save(shared_weight_decoder(), tmp_path / "shared.onnx")
    model = load(tmp_path / "shared.onnx")
    before = model.proto.SerializeToString()
    weights, undo = branches.read_in_place(model)
    assert weights == {"w_in": W_IN.nbytes, "w_out": W_OUT.nbytes}
    for _, _, g in graph_paths(model.proto.graph)[1:]:
        assert list(g.node[0].input)[0] == "ids"  # the chain comes first and reads a graph input: nothing folds it
        readers = [n for n in g.node if n.op_type == "MatMul" and n.input[1] in ("w_in", "w_out")]
        assert readers == []  # every weight through a view
    monkeypatch.chdir(tmp_path)  # the shell's large tensors lie in shared.onnx itself, where the checker looks
    onnx.checker.check_model(model.proto, full_check=True)  # in order, typed
    undo()
    assert model.proto.SerializeToString() == before


# --- what a retie that reads a merged decoder's weights in place claims of its other outputs --------------------------

def legacy_sessions(path):
    """{how: session} of a model as a user runs it (onnxruntime's defaults) and with prepacking off."""
    import onnxruntime as ort
    unpacked = ort.SessionOptions()
    unpacked.add_session_config_entry("session.disable_prepacking", "1")
    return {"defaults": ort.InferenceSession(str(path)), "unpacked": ort.InferenceSession(str(path), unpacked)}


def test_the_proof_feeds_one_new_token_after_past_0_and_3():
    from runtime import feeds
    source = os.path.join(FOLDERS, "optimum_gpt2_legacy_merged", "decoder_model_merged.onnx")
    shape = feeds.plan(onnx.load(source, load_external_data=False), source)
    assert [[0, 1], [3, 1]] == [s for s in shape["steps"] if s[0] != shape["past"]]
    assert [shape["past"], 1] in shape["steps"] and [shape["past"], 3] in shape["steps"]
    assert feeds.describe(shape) == "3 new tokens after past 4 (the default); 1 after past 4, 0 and 3"
    # a model whose past length is fixed, or with --proof-past, runs at that past alone
    assert [s[0] for s in feeds.plan(onnx.load(source, load_external_data=False), source, past=5)["steps"]] == [5, 5]


@pytest.mark.slow
def test_retie_legacy_merged_gpt2_states_the_bound_of_its_other_outputs(tmp_path):
    from runtime import feeds
    folder = os.path.join(FOLDERS, "optimum_gpt2_legacy_merged")
    source = os.path.join(folder, "decoder_model_merged.onnx")
    out = tmp_path / "out"
    done = run_inspect(folder, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [x for x in unwrapped(done.stdout) if x.startswith("retie: decoder_model_merged.onnx: ") and
               "proven" in x]
    assert "1 after past 4, 0 and 3" in line  # the feeds that show a one-row product
    assert "every other output bit for bit with the export's run under session.disable_prepacking=1; under the " \
        "defaults" in line
    stated = float(line.split("its outputs lay within ")[1].split(" ")[0])
    model = onnx.load(source, load_external_data=False)
    shape = feeds.plan(model, source)
    export, retied = legacy_sessions(source), legacy_sessions(out / "decoder_model_merged.onnx")
    names = [o.name for o in export["defaults"].get_outputs()]
    most = 0.0
    for past in (0, 3):  # one new token: MLAS multiplies the row without the packed kernel the export's defaults use
        for flag in (True, False):
            inputs = dict(feeds.shaped_feeds(model, {"input_ids": VOCAB}, shape, 1, past=past),
                          use_cache_branch=np.array([flag]))  # the proof's feeds (seed 0)
            runs = {how: dict(zip(names, s.run(names, inputs))) for how, s in {**export, "retied": retied["defaults"]}
                    .items()}
            for name in (n for n in names if n != "logits"):
                old, new = runs["unpacked"][name], runs["retied"][name]
                assert (old.shape, old.dtype) == (new.shape, new.dtype), name
                assert np.array_equal(old.view(np.uint32), new.view(np.uint32)), (name, past, flag)
                gap = np.abs(runs["defaults"][name].astype(np.float64) - new)
                assert np.all(gap <= stated), (name, past, flag, gap.max(), stated)
                most = max(most, float(gap.max(initial=0.0)))
    assert 0 < most <= stated  # the premise: the export's defaults give other bits, within what the line states


@pytest.mark.slow
def test_a_folders_later_file_has_its_shared_weights_read_in_place_in_out(tmp_path):
    # failed before: OUT was staged once, at the first file's proof, so the merged decoder after it was proven with
    # its weights read in place while its staged copy still read them as exported; the proof then failed and the
    # weights were put back ("left as they are")
    folder = tmp_path / "folder"
    folder.mkdir()
    with open(os.path.join(FIXTURES, "torchscript_tied.onnx"), "rb") as f:  # a table stored twice: rewritten first
        (folder / "a.onnx").write_bytes(f.read())
    onnx.save(shared_weight_decoder(), folder / "merged.onnx")
    out = tmp_path / "out"
    done = run_inspect(folder, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = " ".join(unwrapped(done.stdout))
    assert "a.onnx: embed.weight is now the one copy" in printed and "left as they are" not in printed
    assert "merged.onnx: table is now the one copy" in printed and "the 2 weights its branches share" in printed
    model = onnx.load(out / "merged.onnx", load_external_data=False)
    stored = {t.name for t in model.graph.initializer}
    assert not [n.name for _, _, g in graph_paths(model.graph) for n in g.node
                if n.op_type in ("MatMul", "Gemm") and n.input[1] in stored]  # each reads a run-time view
