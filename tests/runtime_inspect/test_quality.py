"""The price of a lossy retie (--lookup-from-head), measured as the field measures a quantization: teacher-forced
over a text, KL(original || OUT), the same top token, perplexities, and the same against a float reference. Every
expected figure is recomputed here with numpy from logits onnxruntime gives on windows cut here, apart from the code
under test (runtime.inspect.sandbox.quality, runtime.inspect.retie.quality)."""
import json
import math
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from runtime.inspect.retie import quality
from runtime.inspect.sandbox import quality as child
from tests.helpers import FIXTURES, inspected, refused, run_inspect, unwrapped

TEXT = quality.DEFAULT_TEXT


def trained_tokenizer(path, vocab=512, opening=None):
    """A byte-level BPE tokenizer of `vocab` ids trained on the lab's text, saved at `path`; `opening`, where given,
    is a special token its post-processor puts at each text's start (as Llama's BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    made = Tokenizer(models.BPE())
    made.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    made.decoder = decoders.ByteLevel()
    specials = [opening] if opening else []
    made.train([TEXT], trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                           special_tokens=specials, show_progress=False))
    if opening:
        made.post_processor = processors.TemplateProcessing(single=f"{opening} $A", special_tokens=[
            (opening, made.token_to_id(opening))])
    made.save(str(path))
    return made


def tiny_decoder(path, table, head):
    """input_ids [1, S] -> Gather(table) -> tanh -> MatMul(head) -> logits [1, S, V], plus each position's previous
    token's row (a shift: the logits depend on the order of the ids, so a window read one position off is seen)."""
    vocab, width = table.shape
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["rows"]),
             helper.make_node("Pad", ["rows", "pads"], ["padded"]),
             helper.make_node("Slice", ["padded", "zero", "minus_one", "one"], ["previous"]),
             helper.make_node("Add", ["rows", "previous"], ["mixed"]),
             helper.make_node("Tanh", ["mixed"], ["hidden"]),
             helper.make_node("MatMul", ["hidden", "head"], ["logits"])]
    inits = [numpy_helper.from_array(table, "table"), numpy_helper.from_array(head, "head"),
             numpy_helper.from_array(np.array([0, 1, 0, 0, 0, 0], np.int64), "pads"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", vocab])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def logits_of(path, window):
    """onnxruntime's logits of one window, here: [len(window), vocab]."""
    session = ort.InferenceSession(path)
    (out,) = session.run(["logits"], {"input_ids": np.array([window], np.int64)})
    return out[0].astype(np.float64)


def expected(p_path, q_path, windows):
    """KL(P || Q) per scored position, same top, and both perplexities, recomputed: probabilities by exp/sum over the
    vocabulary, KL = sum p log(p / q), the logits at a window's position i scored against its token i + 1."""
    kl, same, nll_p, nll_q = [], [], [], []
    for window in windows:
        p_logits, q_logits = logits_of(p_path, window)[:-1], logits_of(q_path, window)[:-1]
        for i, target in enumerate(window[1:]):
            p = np.exp(p_logits[i] - p_logits[i].max())
            p /= p.sum()
            q = np.exp(q_logits[i] - q_logits[i].max())
            q /= q.sum()
            kl.append(float(np.sum(p * np.log(p / q))))
            same.append(int(np.argmax(p)) == int(np.argmax(q)))
            nll_p.append(-math.log(p[target]))
            nll_q.append(-math.log(q[target]))
    return kl, same, math.exp(np.mean(nll_p)), math.exp(np.mean(nll_q))


def spec(path):
    return {"model": path, "ids": "input_ids", "logits": "logits", "rows": {"input_ids": 64},
            "shape": {"past": 0, "head_size": None}}


def test_the_measure_is_kl_of_the_original_over_out_on_the_next_tokens(tmp_path):
    rng = np.random.default_rng(0)
    table, head = rng.standard_normal((64, 16)).astype(np.float32), rng.standard_normal((16, 64)).astype(np.float32)
    original = tiny_decoder(tmp_path / "original.onnx", table, head)
    out = tiny_decoder(tmp_path / "out.onnx", table + 0.3 * rng.standard_normal(table.shape).astype(np.float32),
                       head)
    reference = tiny_decoder(tmp_path / "reference.onnx", table, 1.5 * head)
    windows = [rng.integers(0, 64, size=n).tolist() for n in (9, 9, 5)]
    got = child.measure({"original": spec(original), "out": spec(out), "reference": spec(reference),
                         "windows": windows})
    kl, same, ppl_p, ppl_q = expected(original, out, windows)
    assert got.tokens_scored == len(kl) == 8 + 8 + 4  # every position after a window's first
    assert got.kld_mean == pytest.approx(np.mean(kl), rel=1e-9)
    assert got.kld_p99 == pytest.approx(np.percentile(kl, 99), rel=1e-9)
    assert got.same_top == pytest.approx(np.mean(same))
    assert got.ppl_original == pytest.approx(ppl_p, rel=1e-9) and got.ppl_out == pytest.approx(ppl_q, rel=1e-9)
    reverse = expected(out, original, windows)[0]  # the other direction differs: the test can tell them apart
    assert abs(np.mean(reverse) - np.mean(kl)) > 1e-3 * np.mean(kl)
    kl_old, same_old, ppl_ref, _ = expected(reference, original, windows)
    kl_new, same_new, _, _ = expected(reference, out, windows)
    r = got.reference
    assert r.kld_mean_original == pytest.approx(np.mean(kl_old), rel=1e-9)
    assert r.kld_mean_out == pytest.approx(np.mean(kl_new), rel=1e-9)
    assert (r.same_top_original, r.same_top_out) == (pytest.approx(np.mean(same_old)), pytest.approx(np.mean(same_new)))
    assert r.ppl == pytest.approx(ppl_ref, rel=1e-9)


def test_a_token_one_model_rules_out_is_an_infinite_divergence_not_a_nan():
    p = np.array([[0.0, 1.0, -np.inf]])
    q = np.array([[0.0, -np.inf, 2.0]])
    kl, same, nll_p, nll_q = child.compared(p, q, np.array([0]))
    assert np.isinf(kl[0]) and kl[0] > 0  # P allows token 1, Q rules it out
    kl, _, _, _ = child.compared(q, q, np.array([0]))
    assert kl[0] == 0.0  # Q's ruled-out token adds nothing against itself


def test_windows_open_with_the_tokenizers_start_and_cut_the_text_in_order(tmp_path):
    made = trained_tokenizer(tmp_path / "tokenizer.json", opening="<s>")
    bos = made.token_to_id("<s>")
    text = quality.Text(TEXT, "t")
    cut = quality.windows(made, text, 100, scored=500)
    assert all(w[0] == bos and bos not in w[1:] for w in cut)
    assert all(len(w) == 100 for w in cut)
    assert sum(len(w) - 1 for w in cut) >= 500 > sum(len(w) - 1 for w in cut[:-1])  # enough, and no more
    stream = made.encode(open(TEXT, encoding="utf-8").read(), add_special_tokens=False).ids
    assert [i for w in cut for i in w[1:]] == stream[:99 * len(cut)]  # non-overlapping, in the text's order
    plain = trained_tokenizer(tmp_path / "plain.json")
    assert quality.opening(plain) == []
    short = tmp_path / "short.txt"
    short.write_text("a few words only\n", encoding="utf-8")
    (only,) = quality.windows(plain, quality.Text(str(short), "short"), 100)
    assert only == plain.encode("a few words only\n").ids  # fewer, where the text is shorter


def transformersjs_folder(tmp_path):
    """A transformers.js folder: the tiny GPT-2 float model (onnx/model.onnx) and its q4 quantization
    (onnx/model_q4.onnx, onnxruntime's MatMulNBits quantizer's), a tokenizer.json of its 512 ids, a config.json."""
    root = tmp_path / "tjs"
    (root / "onnx").mkdir(parents=True)
    shutil.copy(os.path.join(FIXTURES, "optimum_gpt2", "model.onnx"), root / "onnx" / "model.onnx")
    shutil.copy(os.path.join(FIXTURES, "ortquant_q4", "model.onnx"), root / "onnx" / "model_q4.onnx")
    (root / "config.json").write_text(json.dumps({"model_type": "gpt2", "tie_word_embeddings": True}))
    return root, trained_tokenizer(root / "tokenizer.json")


def gpt2_logits(path, window):
    """The GPT-2 fixture's logits of a window from an empty past, fed here as its client feeds it."""
    session = ort.InferenceSession(str(path))
    feeds = {}
    for i in session.get_inputs():
        if "past" in i.name:
            feeds[i.name] = np.zeros([1 if d == "batch_size" else 0 if "sequence" in str(d) else d for d in i.shape],
                                     np.float32)
    n = len(window)
    feeds.update(input_ids=np.array([window], np.int64), attention_mask=np.ones((1, n), np.int64),
                 position_ids=np.arange(n, dtype=np.int64)[None])
    return session.run(["logits"], feeds)[0][0].astype(np.float64)


def test_retie_says_its_price_against_the_original_and_the_fp32_variant(tmp_path):
    root, made = transformersjs_folder(tmp_path)
    done = inspected(root, "--dtype", "q4", "--retie", tmp_path / "out", "--lookup-from-head", "--json")
    (record,) = json.loads(done.stdout)["retie"]["quality"]
    # the windows, cut here: GPT-2's 128 learned positions bound them; no opening token in this tokenizer
    stream = made.encode(open(TEXT, encoding="utf-8").read(), add_special_tokens=False).ids
    count = math.ceil(4096 / 127)
    windows = [stream[i:i + 128] for i in range(0, 128 * count, 128)]
    assert record["window"] == 128 and record["tokens_scored"] == 127 * count >= 4096
    logits = {name: [gpt2_logits(path, w)[:-1] for w in windows] for name, path in (
        ("fp32", root / "onnx" / "model.onnx"), ("q4", root / "onnx" / "model_q4.onnx"),
        ("out", tmp_path / "out" / "onnx" / "model_q4.onnx"))}
    targets = np.concatenate([np.array(w[1:]) for w in windows])

    def measured(p, q):
        lp = np.concatenate(logits[p])
        lq = np.concatenate(logits[q])
        lp = lp - lp.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        lq = lq - lq.max(-1, keepdims=True)
        lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
        kl = (np.exp(lp) * (lp - lq)).sum(-1)
        rows = np.arange(len(targets))
        return (kl.mean(), np.percentile(kl, 99), (lp.argmax(-1) == lq.argmax(-1)).mean(),
                math.exp(-lp[rows, targets].mean()), math.exp(-lq[rows, targets].mean()))

    # onnxruntime's sums in the child and here: the same kernels on the same inputs; 1e-6 allows a thread split
    kl, p99, same, ppl_q4, ppl_out = measured("q4", "out")
    assert record["kld_mean"] == pytest.approx(kl, rel=1e-6) and record["kld_p99"] == pytest.approx(p99, rel=1e-6)
    assert record["same_top"] == pytest.approx(same, abs=1e-9)
    assert record["ppl_original"] == pytest.approx(ppl_q4, rel=1e-6)
    assert record["ppl_out"] == pytest.approx(ppl_out, rel=1e-6)
    ref = record["reference"]
    assert ref["model"].endswith(os.path.join("onnx", "model.onnx"))  # the folder's fp32 variant
    kl_q4, _, same_q4, ppl_fp32, _ = measured("fp32", "q4")
    kl_out, _, same_out, _, _ = measured("fp32", "out")
    assert ref["kld_mean_original"] == pytest.approx(kl_q4, rel=1e-6)
    assert ref["kld_mean_out"] == pytest.approx(kl_out, rel=1e-6)
    assert (ref["same_top_original"], ref["same_top_out"]) == (pytest.approx(same_q4), pytest.approx(same_out))
    assert ref["ppl"] == pytest.approx(ppl_fp32, rel=1e-6)
    said = [line for line in unwrapped(done.stderr) if line.startswith("retie: onnx/model_q4.onnx: ")]
    assert "its price, teacher-forced on" in said[0] and "against the float model" in said[1]  # they lead


def test_a_model_without_a_tokenizer_says_its_price_was_not_measured(tmp_path):
    done = inspected(os.path.join(FIXTURES, "ortquant_q4", "model.onnx"), "--retie", tmp_path / "out.onnx",
                     "--lookup-from-head", "--json")
    assert json.loads(done.stdout)["retie"]["quality"] == {
        "file": os.path.join(FIXTURES, "ortquant_q4", "model.onnx"),
        "not_measured": "no tokenizer.json beside the model (and the tokenizers library) to make its tokens"}


@pytest.mark.parametrize("case", ["missing", "not_utf8", "empty", "folder", "fifo", "without_lookup"])
def test_a_bad_text_is_one_line_before_anything_is_written(case, tmp_path):
    text = tmp_path / "text"
    if case == "not_utf8":
        text.write_bytes(b"plain words, then \xff\xfe")
    elif case == "empty":
        text.write_bytes(b"")
    elif case == "folder":
        text.mkdir()
    elif case == "fifo":
        os.mkfifo(text)
    elif case == "without_lookup":
        text.write_text("words\n")
    out = tmp_path / "out.onnx"
    flags = [] if case == "without_lookup" else ["--lookup-from-head"]
    done = run_inspect(os.path.join(FIXTURES, "ortquant_q4", "model.onnx"), "--retie", out, *flags, "--text", text,
                       timeout=60)
    assert refused(done, "--text"), done.stderr
    assert os.listdir(tmp_path) == ([] if case == "missing" else ["text"])  # OUT not written, nothing staged


def test_a_short_text_is_scored_whole_and_said_so(tmp_path):
    root, made = transformersjs_folder(tmp_path)
    text = tmp_path / "mine.txt"
    text.write_text("The lighthouse keeper climbed the stairs again. The storm had not ended.\n", encoding="utf-8")
    done = inspected(root, "--dtype", "q4", "--retie", tmp_path / "out", "--lookup-from-head", "--text", text,
                     "--json")
    (record,) = json.loads(done.stdout)["retie"]["quality"]
    ids = made.encode(text.read_text(encoding="utf-8"), add_special_tokens=False).ids
    assert (record["text"], record["tokens_scored"], record["windows"]) == (str(text), len(ids) - 1, 1)
    said = " ".join(unwrapped(done.stderr))
    assert f"teacher-forced on {len(ids) - 1} tokens of {text} (all it has: fewer than the 4096 asked)" in said
