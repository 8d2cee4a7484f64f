"""compare --model's under-trained tokens beyond the unused ones: the reference of tokens a tokenizer never makes
of their own strings, and --verify-under-trained running the model on the candidates. The model here is a tied
"copier" decoder built by hand (an induction head: the rows that followed this token before, scored against every
row), so what it gives a token is computed here with numpy, apart from onnxruntime."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper, save

from tests.test_compare_families import magikarp, table_of
from tests.test_compare_model import run_compare

tokenizers = pytest.importorskip("tokenizers")

# a byte-level BPE whose merges never make "abc" or "xyz" of their own strings: b+c merges before a+b, and no merge
# joins a to bc (x, yz likewise); "ab", "bc", "yz" are made
LETTERS = list("abcxyz")
NEVER = ["abc", "xyz"]
MERGES = [("b", "c"), ("a", "b"), ("ab", "c"), ("y", "z"), ("x", "y"), ("xy", "z")]


def copier(path, table):
    """A tied decoder that copies as an induction head does: at each position, the rows of the tokens that followed
    the earlier occurrences of this position's token, summed, scored against every row (input_ids [1, S] ->
    logits [1, S, V])."""
    const = lambda name, value: numpy_helper.from_array(np.array(value, np.int64), name)
    nodes = [helper.make_node("Gather", ["embedding", "input_ids"], ["rows"]),
             helper.make_node("Slice", ["rows", "one", "end", "one"], ["later"]),
             helper.make_node("Pad", ["later", "pads"], ["next"]),  # next[i] = rows[i + 1], zeros at the end
             helper.make_node("Unsqueeze", ["input_ids", "two"], ["column"]),
             helper.make_node("Unsqueeze", ["input_ids", "one"], ["row"]),
             helper.make_node("Equal", ["column", "row"], ["same"]),
             helper.make_node("Cast", ["same"], ["same_float"], to=TensorProto.FLOAT),
             helper.make_node("Trilu", ["same_float", "minus_one"], ["earlier"], upper=0),  # j < i only
             helper.make_node("MatMul", ["earlier", "next"], ["hidden"]),
             helper.make_node("Transpose", ["embedding"], ["head"], perm=[1, 0]),
             helper.make_node("MatMul", ["hidden", "head"], ["logits"])]
    inits = [numpy_helper.from_array(table, "embedding"), const("one", [1]), const("two", [2]),
             const("end", [2**62]), const("pads", [0, 0, 0, 0, 1, 0]), const("minus_one", -1)]
    graph = helper.make_graph(nodes, "copier", [helper.make_tensor_value_info("input_ids", TensorProto.INT64,
                                                                              [1, "sequence"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "sequence", len(table)])],
                              inits)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path / "model.onnx"))
    return path / "model.onnx"


def copier_probability(table, ids, token, steps):
    """What the copier gives `token` at most over `steps` greedy steps after `ids`: numpy, float64."""
    table64, tokens, most = table.astype(np.float64), list(ids), 0.0
    for _ in range(steps):
        last = len(tokens) - 1
        hidden = np.zeros(table64.shape[1])
        for j in range(last):
            if tokens[j] == tokens[last]:
                hidden += table64[tokens[j + 1]]
        logits = hidden @ table64.T
        p = np.exp(logits - logits.max())
        p /= p.sum()
        most = max(most, p[token])
        tokens.append(int(np.argmax(logits)))
    return most


def byte_level(words, special=()):
    """A byte-level BPE tokenizer.json: the printable bytes, LETTERS' merges, `words` whole, `special` added."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for token in ["bc", "ab", "abc", "yz", "xy", "xyz"] + [w for w in words if w not in alphabet]:
        vocab.setdefault(token, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=MERGES + [(w[0], w[1:]) for w in words if len(w) > 1]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(special))
    return tokenizer


def test_without_unused_tokens_the_reference_is_the_tokens_never_made(tmp_path):
    """SmolLM2's and GPT-2's vocabularies mark nothing unused: the reference is then the tokens the tokenizer's
    merges never make of their own strings, here "abc" and "xyz" by construction (and not the special token)."""
    tokenizer = byte_level([], special=["<|endoftext|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    never = [tokenizer.token_to_id(t) for t in NEVER]
    rng = np.random.default_rng(3)
    table = rng.standard_normal((vocab, 24)).astype(np.float32)
    direction = rng.standard_normal(24)
    planted = [5, 40, 77]  # rows like the never-made ones (what training left alone), a little nearer their mean
    for i in never + planted:
        table[i] = 0.02 * direction + (0.002 if i in never else 0.0005) * rng.standard_normal(24)
    copier(tmp_path, table)
    found = table_of(run_compare("--model", tmp_path / "model.onnx", "--query", "0", "--json", "-"))
    under = found["under_trained"]
    assert under["reference"]["count"] == 2 and "never makes" in under["reference"]["how"]
    expected = magikarp(table, never)
    threshold = np.percentile(expected[never], 5)
    assert abs(under["threshold"] - threshold) < 1e-6
    assert sorted(c["id"] for c in under["candidates"]) == sorted(set(np.flatnonzero(expected >= threshold))
                                                                  - set(never)) == planted


def test_verify_runs_the_model_and_confirms_only_rows_it_cannot_copy(tmp_path):
    """The copier copies a token in proportion to its row's length and direction: the planted small rows, which the
    indicator ranks first, it gives under 1% (confirmed); a trained row it copies (not confirmed). Every
    probability is the numpy copier's within float32's rounding."""
    from runtime.compare.real import verify
    tokenizer = byte_level([], special=[f"<unused{i}>" for i in range(12)])  # the prompt made of bytes
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    unused = [tokenizer.token_to_id(f"<unused{i}>") for i in range(12)]
    rng = np.random.default_rng(4)
    table = rng.standard_normal((vocab, 32)).astype(np.float32)
    direction = rng.standard_normal(32)
    planted = [30, 60, 90]  # letters the prompt does not use
    for i in unused + planted:
        table[i] = 0.02 * direction + (0.002 if i in unused else 0.0005) * rng.standard_normal(32)
    copier(tmp_path, table)
    done = run_compare("--model", tmp_path / "model.onnx", "--query", "0", "--verify-under-trained", "3", "--json",
                       "-")
    under = table_of(done)["under_trained"]
    assert sorted(c["id"] for c in under["candidates"][:3]) == planted
    verified = under["verified"]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
    for t in verified["tokens"]:
        want = copier_probability(table, verify.prompt_ids(encode, t["id"]), t["id"], verify.STEPS)
        assert abs(t["probability"] - want) <= 1e-5 + 1e-3 * want, t
    assert (verified["checked"], verified["confirmed"]) == (3, 3)
    (control,) = verified["controls"]  # the query, token 0: a trained row, which the copier copies
    want = copier_probability(table, verify.prompt_ids(encode, 0), 0, verify.STEPS)
    assert control["id"] == 0 and want > 0.5 and abs(control["probability"] - want) <= 1e-5 + 1e-3 * want
    said = " ".join(done.stdout.split())
    assert "3 of the top 3 candidates confirmed" in said and "the queries, asked the same way: " in said
    trained = next(i for i in range(vocab) if i not in unused + planted and np.linalg.norm(table[i]) > 5)

    from runtime.compare.real.source import find_table
    from runtime.compare.real.tokens import Vocabulary
    ran = verify.verify(find_table(str(tmp_path / "model.onnx")), Vocabulary([None] * vocab, tokenizer),
                        [{"id": trained, "token": None}, {"id": planted[0], "token": None}], 2)
    want = copier_probability(table, verify.prompt_ids(encode, trained), trained, verify.STEPS)
    assert want > 0.5 and abs(ran["tokens"][0]["probability"] - want) <= 1e-5 + 1e-3 * want
    assert (ran["checked"], ran["confirmed"], ran["controls"]) == (2, 1, [])


def test_verify_says_why_it_cannot_run(tmp_path):
    from tests.test_compare_families import write_gguf
    tokens = [f"w{i}" for i in range(40)] + [f"<unused{i}>" for i in range(10)]
    path, _ = write_gguf(tmp_path / "u.gguf", "llama", tokens)
    done = run_compare("--model", path, "--query", "0", "--verify-under-trained", "2", "--json", "-")
    verified = table_of(done)["under_trained"]["verified"]
    assert verified["checked"] == 0 and "GGUF" in verified["why"]
    assert "not verified: a GGUF file" in " ".join(done.stdout.split())
    done = run_compare("--model", path, "--verify-under-trained", "0")
    assert done.returncode == 2 and "--verify-under-trained must be at least 1" in done.stderr
