"""What a session holds (runtime.model.findings.counting and .sandbox.memory): the copies onnxruntime folds
and prepacks, resident memory under its default SessionOptions measured in fresh processes, and the tie where users
run models, onnxruntime-genai's Generator, before and after --retie."""
import json
import os
import shutil

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from tests.helpers import BLOCK, FIXTURES, PROMPTS, VOCAB, WIDTH, findings, folded, genai_tokens, inspected, relations


def prepacked(data, name):
    return [(c["kernel"], c["bytes"]) for c in data["runtime_copies"] if c.get("view") == "prepacked"
            and c["copy_of"] == name]


def entry(path, table=None, timeout=600, verbose=False):
    """The vocabulary entry of `table` (or the first) in `inspect PATH --json` (600 s: tables of real sizes);
    `verbose`: --verbose, under which prepacking off is measured too."""
    args = ["--json"] + (["--verbose"] if verbose else [])
    vocabulary = json.loads(inspected(path, *args, timeout=timeout).stdout)["vocabulary"]
    return next(v for v in vocabulary if table in (None, v["table"]))


# --- copies onnxruntime folds and prepacks ----------------------------------------------------------------------------

def test_inspect_dynamo_large_table_is_copied_at_run_time():
    data = findings(os.path.join(FIXTURES, "dynamo_tied_large.onnx"))
    assert relations(data) == [("lm_head.weight", "lm_head.weight", "shared", 0)]
    copies = [c for c in folded(data) if c.get("copy_of") == "lm_head.weight"]
    assert [(c["bytes"], c["transposed"], c["shape"]) for c in copies] == [(1024 * 64 * 4, True, [64, 1024])]


def test_inspect_genai_fp32_shared_embeddings():
    data = findings(os.path.join(FIXTURES, "genai_fp32", "model.onnx"))
    (entry,) = data["vocabulary"]
    assert {k: entry[k] for k in ("table", "vocab_size", "width", "format", "bytes", "tied", "head")} == {
        "table": "lm_head.MatMul.weight", "vocab_size": VOCAB, "width": WIDTH, "format": "float32",
        "bytes": VOCAB * WIDTH * 4, "tied": True, "head": "lm_head.MatMul.weight"}
    # onnxruntime folds the lookup's Transpose into a second table, and prepacks the head's weight into a third,
    # freeing the original (its only reader packed it): two copies under the defaults, two with prepacking off
    assert entry["tables_in_memory"] == 2
    assert [entry["in_memory"][s]["copies"] for s in ("defaults", "no_prepacking")] == [2, 2]
    assert entry["onnxruntime"] == ort.__version__  # whose folding and prepacking these counts are
    (copy,) = [c for c in folded(data) if c.get("copy_of") == "lm_head.MatMul.weight"]
    assert (copy["view"], copy["shape"], copy["bytes"]) == ("transposed", [VOCAB, WIDTH], VOCAB * WIDTH * 4)
    assert prepacked(data, "lm_head.MatMul.weight") == [("MatMul", VOCAB * WIDTH * 4)]


def test_inspect_genai_int4_shared_embeddings():
    data = findings(os.path.join(FIXTURES, "genai_int4", "model.onnx"))
    (entry,) = data["vocabulary"]
    packed, scales = VOCAB * WIDTH // 2, VOCAB * (WIDTH // BLOCK) * 4  # two codes a byte; a float32 scale a block
    assert {k: entry[k] for k in ("table", "vocab_size", "width", "format", "bytes", "tied", "head")} == {
        "table": "lm_head.MatMul.weight_Q4", "vocab_size": VOCAB, "width": WIDTH, "format": "int4",
        "bytes": packed + scales, "tied": True, "head": "lm_head.MatMul.weight_Q4"}
    # the Reshape before GatherBlockQuantized is folded into a copy, and MatMulNBits prepacks the codes (freeing them)
    assert entry["tables_in_memory"] == 2
    (copy,) = [c for c in folded(data) if c.get("copy_of") == "lm_head.MatMul.weight_Q4"]
    assert (copy["view"], copy["bytes"]) == ("reshaped", packed)
    assert [kernel for kernel, _ in prepacked(data, "lm_head.MatMul.weight_Q4")] == ["MatMulNBits"]


def test_inspect_genai_fp16_counts_the_float32_copy():
    """onnxruntime's CPU provider runs the float16 head through a float32 MatMul: the inserted Cast is folded into a
    float32 copy of the table (beside the Transpose's float16 copy), and inspect says whose it is."""
    data = findings(os.path.join(FIXTURES, "genai_fp16", "model.onnx"))
    (entry,) = data["vocabulary"]
    # the stored table is dropped once both its readers are folded; the float32 copy is prepacked and then freed:
    # a float16 copy and a packed float32 one under the defaults, three tensors with prepacking off
    assert (entry["format"], entry["bytes"], entry["tied"], entry["tables_in_memory"]) == (
        "float16", VOCAB * WIDTH * 2, True, 2)
    views = sorted((c["view"], c["bytes"]) for c in folded(data) if c.get("copy_of") == entry["table"])
    assert views == [("transposed", VOCAB * WIDTH * 2), ("widened", VOCAB * WIDTH * 4)]
    (widened,) = [c["name"] for c in folded(data) if c.get("view") == "widened" and c["copy_of"] == entry["table"]]
    assert prepacked(data, widened) == [("MatMul", VOCAB * WIDTH * 4)]


# --- onnxruntime-genai's runtime --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["genai_fp32", pytest.param("genai_int4", marks=pytest.mark.slow)])
def test_genai_generates_the_same_tokens_after_retie(fixture, tmp_path):
    source = os.path.join(FIXTURES, fixture)
    out = tmp_path / "retied" / "model.onnx"
    out.parent.mkdir()
    said = inspected(os.path.join(source, "model.onnx"), "--retie", out).stdout
    assert "copied genai_config.json beside OUT" in said
    before, after = genai_tokens(source), genai_tokens(out.parent)
    assert len(after) == len(PROMPTS) and all(len(t) == 12 for t in after)
    assert after == before


def test_retie_names_out_in_genai_config_and_never_replaces_a_file(tmp_path):
    source = os.path.join(FIXTURES, "genai_fp32")
    (tmp_path / "tokenizer_config.json").write_text("mine\n")  # a file of the user's that must stay
    model_folder = tmp_path / "model"
    shutil.copytree(source, model_folder)  # the fixture has no tokenizer files: give the copy two
    (model_folder / "tokenizer_config.json").write_text('{"from": "the model"}\n')
    (model_folder / "vocab.json").write_text('{"a": 0}\n')
    out = tmp_path / "retied.onnx"
    said = inspected(model_folder / "model.onnx", "--retie", out).stdout
    assert "tokenizer_config.json exists beside OUT: left as it is" in said
    assert "copied vocab.json beside OUT" in said
    assert (tmp_path / "tokenizer_config.json").read_text() == "mine\n"
    assert (tmp_path / "vocab.json").read_text() == '{"a": 0}\n'
    config = json.loads((tmp_path / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "retied.onnx"
    original = json.loads((model_folder / "genai_config.json").read_text())
    original["model"]["decoder"]["filename"] = "retied.onnx"
    assert config == original  # nothing else changed
    assert genai_tokens(tmp_path) == genai_tokens(model_folder)


def test_retie_beside_its_input_leaves_genai_config_alone(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(os.path.join(FIXTURES, "genai_fp32"), folder)
    config = (folder / "genai_config.json").read_bytes()
    said = inspected(folder / "model.onnx", "--retie", folder / "retied.onnx").stdout
    assert "genai_config.json names 'model.onnx', not OUT: it is not changed" in said
    assert (folder / "genai_config.json").read_bytes() == config


# --- resident memory under onnxruntime's defaults ---------------------------------------------------------------------

V, D = 16384, 512  # a 32 MiB table: well above a session's own few MiB


def constant_head_tied(table):
    """The lab's tied graph as it was: the head reads the table as a constant, which the defaults prepack."""
    vocab, width = table.shape
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embedding", "ids"], ["embeddings"], axis=0),
         helper.make_node("FusedMatMul", ["hidden", "embedding"], ["logits"], domain="com.microsoft", transB=1)],
        "constant_head", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
                          helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", width])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", "seq", width]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab])],
        [numpy_helper.from_array(table, "embedding")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def test_the_lab_tied_head_holds_one_table_under_onnxruntime_defaults(tmp_path):
    table = graphs.make_table(V, D)
    graphs.save(graphs.tied_logits(table), tmp_path / "tied.onnx", external=True)
    graphs.save(constant_head_tied(table), tmp_path / "constant.onnx", external=True)
    tied, constant = entry(tmp_path / "tied.onnx", verbose=True), entry(tmp_path / "constant.onnx")
    for held in (tied["in_memory"]["defaults"], tied["in_memory"]["no_prepacking"]):
        assert held["copies"] == 1 and held["times_table"] <= 1.25, held
    assert tied["in_memory"]["defaults"]["anonymous_bytes"] < 0.25 * V * D * 4  # the table stays file-backed
    # the same test tells the old form apart: its head's weight is prepacked into a second table
    assert constant["in_memory"]["defaults"]["copies"] == 2 and constant["in_memory"]["defaults"]["times_table"] >= 1.75
    assert constant["in_memory"]["no_prepacking"]["copies"] == 1
    for held in (tied["in_memory"]["defaults"], tied["in_memory"]["no_prepacking"]):  # what docs/inspect.md names
        assert set(held) == {"copies", "resident_bytes", "anonymous_bytes", "file_bytes", "peak_bytes", "kept_bytes",
                             "times_table"}
    # the high-water mark (RSS) is at least the private memory that stays after the run. Not the Pss figure:
    # a library page another process stopped sharing meanwhile raises this one's Pss, never its RSS (CI saw
    # a Pss growth 4 KiB past the RSS peak once the first child was started ahead of its job)
    for held in (tied["in_memory"]["defaults"], constant["in_memory"]["defaults"]):
        assert held["peak_bytes"] >= held["anonymous_bytes"] > 0


def genai_shared_embeddings(vocab, width, seed=0):
    """onnxruntime-genai's shared-embeddings form, no layers between: the table stored once as the head's
    [width, vocab] MatMul weight, the lookup reading it through a Transpose."""
    weight = np.ascontiguousarray(graphs.make_table(vocab, width, seed).T)
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["lm_head.MatMul.weight"], ["rows"], perm=[1, 0]),
         helper.make_node("Gather", ["rows", "input_ids"], ["hidden"], axis=0),
         helper.make_node("MatMul", ["hidden", "lm_head.MatMul.weight"], ["logits"], name="/lm_head/MatMul")],
        "genai_form", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])],
        [numpy_helper.from_array(weight, "lm_head.MatMul.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


@pytest.mark.slow
def test_retie_at_qwen2_size_holds_one_table_under_the_defaults(tmp_path):
    """151936 x 896 (544 MB), genai's form: two tables under the defaults before --retie, one after."""
    source = tmp_path / "genai" / "model.onnx"
    source.parent.mkdir()
    graphs.save(genai_shared_embeddings(151936, 896), source, external=True)
    before = entry(source)
    assert before["in_memory"]["defaults"]["copies"] == 2 and before["in_memory"]["defaults"]["times_table"] >= 1.9
    out = tmp_path / "retied" / "model.onnx"
    out.parent.mkdir()
    inspected(source, "--retie", out, timeout=600)
    after = entry(out, verbose=True)
    assert after["tied"] and after["in_memory"]["defaults"]["copies"] == 1
    assert after["in_memory"]["defaults"]["times_table"] <= 1.10, after["in_memory"]
    assert after["in_memory"]["no_prepacking"]["times_table"] <= 1.10, after["in_memory"]


def test_free_heap_left_by_earlier_work_is_not_taken_from_a_sessions_growth():
    # failed before: the figures were read after malloc_trim but the baseline before it, so the heap glibc kept of
    # work done earlier in the process (here 3000 blocks of 100 kB freed, every 50th kept) came off the session's
    # growth: an Identity session "added" about -275 MiB
    from runtime import resident
    identity = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]), opset_imports=[helper.make_opsetid("", 13)])
    identity.ir_version = 8
    feeds = {"x": np.ones(1, np.float32)}
    junk = [bytearray(100_000) for _ in range(3000)]
    kept = junk[::50]  # noqa: F841 - held, so that the freed blocks between them cannot be returned whole
    del junk
    figures = resident.sessions_growth([(identity.SerializeToString(), None, feeds)])
    assert abs(figures["resident_bytes"]) < 16 * 2**20, figures  # an Identity session holds almost nothing
