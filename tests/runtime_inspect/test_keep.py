"""--retie OUT --logits-to-keep K (runtime.inspect.retie.keep): an int64 input num_logits_to_keep, default K, whose
value k keeps the last k positions before the head. Checked here in fresh onnxruntime sessions under the default
SessionOptions against the original, with float32's bound on the head's dot products computed in this file from
the hidden state the original's head reads (exposed as an output here) and its weights."""
import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import FIXTURES, FOLDERS, U, findings, genai_tokens, inspected, refused, run_inspect, unwrapped

KEEP = "num_logits_to_keep"


def _session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3  # onnxruntime warns that an input has a default; it is meant to
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _exposing(path, out):
    """The model at `path` saved to `out` with the hidden state its logits MatMul reads as an output too: (that
    name, the head's weight [width, vocab] as float64)."""
    model = onnx.load(path)
    producer = {o: n for n in model.graph.node for o in n.output}
    head = producer["logits"]
    assert head.op_type == "MatMul"
    model.graph.output.append(helper.make_tensor_value_info(head.input[0], TensorProto.FLOAT, None))
    onnx.save(model, out)
    (weight,) = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name == head.input[1]]
    return head.input[0], weight.astype(np.float64)


def _bound(hidden, weight):
    """Two float32 computations of hidden @ weight each lie within gamma_w sum|h w| of the exact sums."""
    w = weight.shape[0]
    gamma = w * U / (1 - w * U)
    return 2 * gamma * (np.abs(hidden.astype(np.float64)) @ np.abs(weight))


def _feeds(session, batch, sequence, past, vocab, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in session.get_inputs():
        if "ids" in value.name and "position" not in value.name:
            feeds[value.name] = rng.integers(0, vocab, (batch, sequence)).astype(np.int64)
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((batch, past + sequence), np.int64)
        elif value.name == "position_ids":
            feeds[value.name] = np.broadcast_to(np.arange(past, past + sequence), (batch, sequence)).astype(np.int64)
        elif value.name.startswith("past_key_values"):
            heads, size = value.shape[1], value.shape[3]
            feeds[value.name] = rng.standard_normal((batch, heads, past, size)).astype(np.float32)
        elif value.name == "use_cache_branch":
            feeds[value.name] = np.array([past > 0])
        else:
            raise AssertionError(f"no feed made for {value.name}")
    return feeds


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _within(new, old, bound):
    return new.shape == old.shape and not np.isnan(new).any() and bool(np.all(np.abs(new - old.astype(np.float64))
                                                                                 <= bound))


CASES = {"optimum_gpt2": [(1, 1, 0), (1, 5, 0), (2, 7, 0), (1, 3, 4), (1, 1, 6)],
         "torchscript_tied": [(1, 1, 0), (1, 5, 0), (2, 9, 0)]}
PATHS = {"optimum_gpt2": os.path.join(FIXTURES, "optimum_gpt2", "model.onnx"),
         "torchscript_tied": os.path.join(FIXTURES, "torchscript_tied.onnx")}


@pytest.mark.parametrize("name, default", [("optimum_gpt2", 1), ("torchscript_tied", 1), ("optimum_gpt2", 0)])
def test_the_retied_head_keeps_the_last_k_positions(name, default, tmp_path):
    out = tmp_path / "kept.onnx"
    said = inspected(PATHS[name], "--retie", out, "--logits-to-keep", str(default)).stdout
    assert f"input {KEEP} (int64 scalar, default {default})" in said.replace("\n    ", " ")
    model = onnx.load(out)
    (keep,) = [i for i in model.graph.input if i.name == KEEP]
    assert keep.type.tensor_type.elem_type == TensorProto.INT64 and len(keep.type.tensor_type.shape.dim) == 0
    (value,) = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name == KEEP]
    assert value.dtype == np.int64 and value.shape == () and value == default
    hidden, weight = _exposing(PATHS[name], tmp_path / "exposed.onnx")
    old, new = _session(tmp_path / "exposed.onnx"), _session(out)
    assert KEEP not in {i.name for i in new.get_inputs()}  # a default: a client that feeds none is served
    vocab = weight.shape[1]
    names = [o.name for o in new.get_outputs()]
    for batch, sequence, past in CASES[name]:
        feeds = _feeds(new, batch, sequence, past, vocab)
        before = dict(zip([o.name for o in old.get_outputs()], old.run(None, feeds)))
        bound = _bound(before[hidden], weight)
        runs = {k: dict(zip(names, new.run(None, dict(feeds, **{KEEP: np.array(k, np.int64)})))) for k in (0, 1)}
        plain = dict(zip(names, new.run(None, feeds)))
        assert all(_same_bits(plain[n], runs[default][n]) for n in names)  # unfed: the default
        for k, like in ((sequence + 3, 0), (-1, 0)):  # past the prompt: all of it; negative: as 0
            fed = dict(zip(names, new.run(None, dict(feeds, **{KEEP: np.array(k, np.int64)}))))
            assert all(_same_bits(fed[n], runs[like][n]) for n in names), k
        assert runs[1]["logits"].shape == (batch, 1, vocab) and runs[0]["logits"].shape == (batch, sequence, vocab)
        assert _within(runs[0]["logits"], before["logits"], bound)
        assert _within(runs[1]["logits"], before["logits"][:, -1:], bound[:, -1:])
        for k in (0, 1):  # the present key/values: bit for bit
            assert all(_same_bits(runs[k][n], before[n]) for n in names if n != "logits")


def test_keeping_alone_changes_no_bit_at_zero(tmp_path):
    # the retied file has nothing left to retie: --logits-to-keep is the only rewrite, so k = 0 is that file
    retied, kept = tmp_path / "retied.onnx", tmp_path / "kept.onnx"
    inspected(PATHS["optimum_gpt2"], "--retie", retied)
    said = inspected(retied, "--retie", kept, "--logits-to-keep", "0").stdout
    assert "is now the one copy" not in said and f"input {KEEP}" in said
    hidden, weight = _exposing(PATHS["optimum_gpt2"], tmp_path / "exposed.onnx")
    old, new, exposed = _session(retied), _session(kept), _session(tmp_path / "exposed.onnx")
    names = [o.name for o in old.get_outputs()]
    for batch, sequence, past in CASES["optimum_gpt2"]:
        feeds = _feeds(old, batch, sequence, past, weight.shape[1])
        before = dict(zip(names, old.run(None, feeds)))
        zero, one = (dict(zip(names, new.run(None, dict(feeds, **{KEEP: np.array(k, np.int64)})))) for k in (0, 1))
        assert all(_same_bits(zero[n], before[n]) for n in names)
        assert all(_same_bits(one[n], before[n]) for n in names if n != "logits")
        (h,) = exposed.run([hidden], feeds)
        assert _within(one["logits"], before["logits"][:, -1:], _bound(h, weight)[:, -1:])
        assert _same_bits(new.run(None, feeds)[0], zero["logits"])  # the default, 0


def test_both_branches_of_a_merged_decoder_keep_the_last_positions(tmp_path):
    source = os.path.join(FOLDERS, "optimum_gpt2_legacy_merged")
    retied, kept = tmp_path / "retied", tmp_path / "kept"
    inspected(source, "--retie", retied)
    said = inspected(source, "--retie", kept, "--logits-to-keep", "1").stdout.replace("\n    ", " ")
    assert f"decoder_model_merged.onnx: logits: input {KEEP} (int64 scalar, default 1)" in said
    model = onnx.load(kept / "decoder_model_merged.onnx")
    (branching,) = [n for n in model.graph.node if n.op_type == "If"]
    for branch in branching.attribute:  # the Slice before the head, in each branch
        assert any(n.op_type == "Slice" and n.name.startswith("keep") for n in branch.g.node), branch.name
    old, new = _session(retied / "decoder_model_merged.onnx"), _session(kept / "decoder_model_merged.onnx")
    names = [o.name for o in old.get_outputs()]
    # the hidden state each branch's head reads, as the legacy pair of files computes it
    without, weight = _exposing(os.path.join(source, "decoder_model.onnx"), tmp_path / "without.onnx")
    with_past, _ = _exposing(os.path.join(source, "decoder_with_past_model.onnx"), tmp_path / "with_past.onnx")
    exposed = {False: (_session(tmp_path / "without.onnx"), without), True: (_session(tmp_path / "with_past.onnx"),
                                                                              with_past)}
    for batch, sequence, past in [(1, 1, 0), (1, 6, 0), (2, 3, 0), (1, 1, 5), (1, 4, 2)]:
        feeds = _feeds(old, batch, sequence, past, weight.shape[1])
        if past == 0:  # the branch that reads no past still declares one: an empty one
            feeds = {k: v if not k.startswith("past") else v[:, :, :0] for k, v in feeds.items()}
        before = dict(zip(names, old.run(None, feeds)))
        zero, one = (dict(zip(names, new.run(None, dict(feeds, **{KEEP: np.array(k, np.int64)})))) for k in (0, 1))
        assert all(_same_bits(zero[n], before[n]) for n in names)
        assert one["logits"].shape == (batch, 1, weight.shape[1])
        assert all(_same_bits(one[n], before[n]) for n in names if n != "logits")
        session, hidden = exposed[past > 0]
        split = {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}}
        (h,) = session.run([hidden], split)
        assert _within(one["logits"], before["logits"][:, -1:], _bound(h, weight)[:, -1:])


@pytest.mark.parametrize("fixture, default", [("genai_fp32", 0), ("genai_fp32", 1), ("genai_int4", 1)])
def test_genai_generates_the_same_tokens_with_either_default(fixture, default, tmp_path):
    # genai sizes its logits buffer by the output's declared shape: [batch, 1, vocab] with the default 1
    source = os.path.join(FIXTURES, fixture)
    said = inspected(os.path.join(source, "model.onnx"), "--retie", tmp_path / "model.onnx", "--logits-to-keep",
                     str(default)).stdout.replace("\n    ", " ")
    if fixture == "genai_int4":  # MatMulNBits at one row rounds otherwise than at three here: its bound, or bits
        assert any(f"with 1 the last position's logits {how}" in said for how in (
            "within MatMulNBits' bound at its accuracy level", "bit for bit")), said
    (logits,) = [o for o in onnx.load(tmp_path / "model.onnx").graph.output if o.name == "logits"]
    positions = logits.type.tensor_type.shape.dim[1]
    assert (positions.dim_value == 1) if default else (positions.dim_param == "sequence_length")
    assert genai_tokens(tmp_path) == genai_tokens(source)


def test_genai_fp16_is_measured_and_kept_as_genai_runs_it(tmp_path):
    # its attention mask takes several new tokens only as a prompt: the measuring run and the proof feed it so
    source = os.path.join(FIXTURES, "genai_fp16")
    (entry,) = findings(os.path.join(source, "model.onnx"))["vocabulary"]
    assert entry["in_memory"]["defaults"]["resident_bytes"] is not None, entry["in_memory"]
    said = " ".join(unwrapped(inspected(source, "--retie", tmp_path / "out", "--logits-to-keep", "1").stdout))
    assert "proven on decoder feeds (3 new tokens after past 0; 1 after past 4 (the default), 0 and 3)" in said
    assert genai_tokens(tmp_path / "out") == genai_tokens(source)


def test_the_verdict_names_the_fix_and_a_kept_model_is_no_finding(tmp_path):
    (entry,) = [e for e in findings(PATHS["torchscript_tied"])["verdict"] if e["kind"] == "all_positions_scored"]
    assert entry["fix"] == "--retie OUT --logits-to-keep 1" and entry["why_not"] is None
    inspected(PATHS["torchscript_tied"], "--retie", tmp_path / "kept.onnx", "--logits-to-keep", "1")
    kept = findings(tmp_path / "kept.onnx")
    assert not [e for e in kept["verdict"] if e["kind"] == "all_positions_scored"] and kept["prefill"] == []
    again = run_inspect(tmp_path / "kept.onnx", "--retie", tmp_path / "again.onnx", "--logits-to-keep", "1")
    assert refused(again, f"already has a tensor named {KEEP}")
    assert not os.path.exists(tmp_path / "again.onnx")


def test_logits_to_keep_refuses_what_it_cannot_do(tmp_path):
    alone = run_inspect(PATHS["torchscript_tied"], "--logits-to-keep", "1")
    assert refused(alone, "--logits-to-keep", "--retie")
    two = run_inspect(PATHS["torchscript_tied"], "--retie", tmp_path / "x.onnx", "--logits-to-keep", "2")
    assert two.returncode == 2 and "invalid choice" in two.stderr and not os.path.exists(tmp_path / "x.onnx")
    seq2seq = run_inspect(os.path.join(FOLDERS, "optimum_t5"), "--retie", tmp_path / "t5", "--logits-to-keep", "1")
    assert refused(seq2seq, "no file of the folder can keep the last positions")
    assert not os.path.exists(tmp_path / "t5")
    model = onnx.load(PATHS["torchscript_tied"])
    (out,) = model.graph.output
    out.type.tensor_type.shape.dim[1].dim_value = 1  # one position scored already
    onnx.save(model, tmp_path / "one.onnx")
    done = run_inspect(tmp_path / "one.onnx", "--retie", tmp_path / "y.onnx", "--logits-to-keep", "0")
    assert refused(done, "no logits head scores every prompt position")


def _fused_head(path, transposed):
    """A tied pair whose head is onnxruntime's FusedMatMul on relu(the looked-up rows), optionally reading them
    transposed (transA=1 on [batch, width, sequence]); its table [64, 16]."""
    table = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["hidden"]),
             helper.make_node("Relu", ["hidden"], ["rows"])]
    if transposed:
        nodes += [helper.make_node("Transpose", ["rows"], ["columns"], perm=[0, 2, 1]),
                  helper.make_node("FusedMatMul", ["columns", "head.weight"], ["logits"], domain="com.microsoft",
                                   transA=1)]
    else:
        nodes.append(helper.make_node("FusedMatMul", ["rows", "head.weight"], ["logits"], domain="com.microsoft"))
    graph = helper.make_graph(
        nodes, "fused", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", 64])],
        [numpy_helper.from_array(table, "embed.weight"), numpy_helper.from_array(table.T.copy(), "head.weight")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.microsoft", 1)]), path)
    return table


def test_a_fused_matmul_head_is_sliced_unless_it_reads_the_rows_transposed(tmp_path):
    table = _fused_head(tmp_path / "plain.onnx", transposed=False)
    inspected(tmp_path / "plain.onnx", "--retie", tmp_path / "kept.onnx", "--logits-to-keep", "1")
    ids = np.array([[3, 60, 7, 12, 41]], np.int64)
    (logits,) = _session(tmp_path / "kept.onnx").run(None, {"input_ids": ids})
    rows = np.maximum(table[ids[:, -1:]], 0).astype(np.float64)  # the last position's, in numpy
    assert _within(logits, rows @ table.T.astype(np.float64), _bound(rows, table.T.astype(np.float64)))
    _fused_head(tmp_path / "transposed.onnx", transposed=True)
    done = run_inspect(tmp_path / "transposed.onnx", "--retie", tmp_path / "t.onnx", "--logits-to-keep", "1")
    assert refused(done, "FusedMatMul reading its hidden state transposed")
    assert not os.path.exists(tmp_path / "t.onnx")


def test_a_head_named_like_a_retied_one_is_told_by_its_structure(tmp_path):
    """An exporter's Gemm head that flattens its hidden state itself, its nodes named as --retie names its own
    (x_flatten, x_tied_head, x_unflatten): refused as any flattening Gemm is, nothing written. Recognised by name,
    it was taken for a head --retie made."""
    table = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["hidden"]),
             helper.make_node("Reshape", ["hidden", "rows_shape"], ["rows"], name="x_flatten"),
             helper.make_node("Gemm", ["rows", "embed.weight"], ["scores"], name="x_tied_head", transB=1),
             helper.make_node("Reshape", ["scores", "logits_shape"], ["logits"], name="x_unflatten")]
    graph = helper.make_graph(
        nodes, "named", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", 64])],
        [numpy_helper.from_array(table, "embed.weight"), numpy_helper.from_array(np.array([-1, 16]), "rows_shape"),
         numpy_helper.from_array(np.array([1, -1, 64]), "logits_shape")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "named.onnx")
    done = run_inspect(tmp_path / "named.onnx", "--retie", tmp_path / "kept.onnx", "--logits-to-keep", "1")
    assert refused(done, "read by Gemm, which flattens the hidden state")
    assert not os.path.exists(tmp_path / "kept.onnx")


# --- the head's share of a prefill (runtime.inspect.sandbox.timing) ----------------------------------------------

def test_the_head_is_timed_in_one_prefill_at_the_prompt_length_on_request():
    (entry,) = findings(PATHS["torchscript_tied"], "--prompt-length", "512", "--time-prefill")["prefill"]
    timing = entry["timing"]
    assert 0 < timing["head_seconds"] <= timing["run_seconds"], timing
    report = inspected(PATHS["torchscript_tied"], "--prompt-length", "512", "--time-prefill").stdout.splitlines()
    (line,) = [x for x in report if x.startswith("  the head: ")]  # another run: its own figures
    assert re.fullmatch(r"  the head: [0-9.]+ m?s of a [0-9.]+ m?s prefill \(\d+%\), measured: one run under "
                        r"onnxruntime's defaults", line), line
    assert "timing" not in findings(PATHS["torchscript_tied"], "--static")["prefill"][0]
    assert refused(run_inspect(PATHS["torchscript_tied"], "--static", "--time-prefill"), "--time-prefill", "--static")


def test_torchscript_head_share_is_counted_without_a_run(monkeypatch, capsys):
    import json

    from runtime.inspect import cli
    from runtime.inspect.sandbox import isolated
    kinds = []
    start = isolated.start
    monkeypatch.setattr(isolated, "start", lambda job, *a, **k: kinds.append(job["kind"]) or start(job, *a, **k))
    monkeypatch.setattr(isolated, "call", lambda job, *a, **k: pytest.fail(f"a {job['kind']} child was run"))
    assert cli.main([PATHS["torchscript_tied"], "--json", "--prompt-length", "512"], supervised=False) == 0
    assert "prefill" not in kinds
    (entry,) = json.loads(capsys.readouterr().out)["prefill"]
    weights = [t for t in onnx.load(PATHS["torchscript_tied"]).graph.initializer if len(t.dims) == 2
               and t.name != "embed.weight"]  # the matmul weights: the head [32, 256] and one [32, 32]
    assert sorted(list(t.dims) for t in weights) == [[32, 32], [32, 256]]
    assert "timing" not in entry
    assert entry["counted"]["head_multiply_adds"] == 512 * 256 * 32  # no attention op in this export
    assert entry["counted"]["multiply_adds"] == 512 * (256 * 32 + 32 * 32)
    assert entry["counted"]["what"] == "512 tokens x the elements of 2 matmul weights"


def test_merged_gpt2_share_counts_one_branchs_attention():
    path = os.path.join(FOLDERS, "optimum_gpt2_legacy_merged")
    (entry,) = findings(path, "--static")["files"][0]["prefill"]
    model = onnx.load(os.path.join(path, "decoder_model_merged.onnx"))
    bodies = [a.g for n in model.graph.node if n.op_type == "If" for a in n.attribute if a.type == a.GRAPH]
    assert [len([n for n in g.node if n.op_type == "Softmax"]) for g in bodies] == [1, 1]  # a prefill runs one
    sizes = {t.name: int(np.prod(t.dims)) for t in model.graph.initializer}
    weights = {n.input[1] for g in bodies for n in g.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in sizes}
    tokens, width = entry["prompt_tokens"], 32  # both branches read the main graph's weights: each counted once
    assert entry["counted"]["multiply_adds"] == tokens * sum(sizes[w] for w in weights) + 2 * tokens**2 * width
    assert entry["counted"]["head_multiply_adds"] == tokens * 256 * width
    assert entry["counted"]["what"] == f"{tokens} tokens x the elements of {len(weights)} matmul weights, and 1 " \
        f"attention op x 2 x {tokens}^2 x {width}"
    line = [x for x in unwrapped(inspected(path).stdout) if x.startswith("  the head: ")][0]
    share = 100 * entry["counted"]["head_multiply_adds"] / entry["counted"]["multiply_adds"]
    assert line.endswith(f" multiply-adds of a prefill ({share:.0f}%), counted (--time-prefill runs it)"), line


def test_a_prefill_past_the_budget_is_not_run_and_says_why(monkeypatch, capsys):
    import json

    from runtime.inspect import cli
    from runtime.inspect.sandbox import timing
    monkeypatch.setattr(timing, "MOST_FLOPS", 2 * 2048 * 256 * 32 - 1)  # the fixture's head at 2048 tokens, less one
    assert cli.main([PATHS["torchscript_tied"], "--json", "--time-prefill"], supervised=False) == 0
    (entry,) = json.loads(capsys.readouterr().out)["prefill"]
    why = entry["timing"]["why"]  # the head: 2 x 2048 x 256 x 32 multiply-adds, 33.6 MFLOP
    assert why.startswith("not timed: a 2048-token prefill is at least ") and "(the head alone 33.6 MFLOP), past " \
        "inspect's budget of 33.6 MFLOP; --prompt-length N times a shorter one" in why, why


def test_the_proof_at_one_position_fails_on_a_row_that_is_not_the_last():
    # the k = 1 comparison is not vacuous: logits of the first position instead of the last are caught
    from runtime.inspect.sandbox import agree
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, 4, 8)).astype(np.float32)
    table = rng.standard_normal((16, 8)).astype(np.float32)
    logits = hidden @ table.T
    old = {"logits": logits, "hidden": hidden}
    last = agree.last_position(old, {"logits", "hidden"})
    assert last["logits"].shape == (1, 1, 16) and np.array_equal(last["hidden"], hidden[:, -1:])
    chains = {"logits": [("logits", 1.0, 0)]}
    heads = {"logits": ("hidden", "table")}
    assert agree.compare(last, {"logits": logits[:, -1:]}, heads, chains, {"table": table}) == []
    assert agree.compare(last, {"logits": logits[:, :1]}, heads, chains, {"table": table}) != []


def test_a_matmulnbits_bound_over_every_run_at_once_is_each_runs_own():
    # the proof decodes the int4 table once for all its runs (agree.nbits_bounds): each run gets what its own
    # decoding gives, in its own shape, and a run without the hidden vector gets none
    from runtime.inspect.sandbox import agree
    from runtime.model.graph.quantized import Quant
    from runtime.model.read.model import load
    model = load(os.path.join(FIXTURES, "genai_int4", "model.onnx"))
    node = next(n for n in model.proto.graph.node if n.op_type == "MatMulNBits" and "lm_head" in n.name)
    attrs = {a.name: a.i for a in node.attribute}
    quant = Quant(codes=node.input[1], scale=node.input[2], zero_point=None, bits=attrs["bits"], blocks=True,
                  width=attrs["K"])
    how = {"quant": quant.__dict__, "block_size": attrs["block_size"], "accuracy_level": attrs["accuracy_level"]}
    rng = np.random.default_rng(3)
    runs = [{"h": rng.standard_normal((1, 3, attrs["K"])).astype(np.float32)}, {},
            {"h": rng.standard_normal((2, 1, attrs["K"])).astype(np.float32)}]
    together = agree.nbits_bounds(model, runs, "h", how)
    assert together[1] is None
    for run, bound in zip((runs[0], runs[2]), (together[0], together[2])):
        alone = agree.nbits_bound(model, run["h"], how)
        assert bound.shape == alone.shape == run["h"].shape[:-1] + (attrs["N"],)
        np.testing.assert_allclose(bound, alone, rtol=1e-12, atol=0)


def test_the_level_4_bound_sums_its_three_terms_each_from_its_own_vectors():
    # quantized_head_bound sums step, h + step and h against |table| in one product: each term from its own rows
    from runtime.bounds import U, U64, gamma, quantized_head_bound
    rng = np.random.default_rng(4)
    hidden, table = rng.standard_normal((3, 64)), rng.standard_normal((10, 64))
    h, t = np.abs(hidden.astype(np.float32).astype(np.float64)), np.abs(table)
    scale = h.reshape(3, 2, 32).max(-1) / 127 * (1 + 2 * U)
    step = np.repeat(scale / 2, 32, axis=1) + 2 * U * h
    expected = (step @ t.T + gamma(4) * ((h + step) @ t.T) + U * (h @ t.T)) * (1 + 2 * 66 * U64)
    np.testing.assert_allclose(quantized_head_bound(hidden.astype(np.float32), table, 32, 4), expected, rtol=1e-12)
