"""compare --model on other model families than SmolLM2's: a SentencePiece and a WordPiece vocabulary in a GGUF
file, a tokenizer.json that pads, Gemma's row scale from the GGUF's architecture, and the under-trained tokens of a
tied table. The GGUF files are written here with the gguf package's own writer; every expected number is computed
here with numpy."""
import json

import numpy as np
import pytest

import graphs
from tests.helpers import refused
from tests.test_compare_model import run_compare

gguf = pytest.importorskip("gguf")

SPM = ["<unk>", "<s>", "</s>", "▁Paris", "▁P", "ar", "is", "▁king", "▁water", "Paris", "▁"]


def write_gguf(path, architecture, tokens, model="llama", table=None, width=16, scores=None):
    """A GGUF file holding a float32 token table (random, seed 0, unless given) and its vocabulary."""
    table = np.random.default_rng(0).standard_normal((len(tokens), width)).astype(np.float32) if table is None \
        else table
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores([float(s) for s in scores])
    writer.add_tensor("token_embd.weight", table)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, table


def table_of(done):
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["table"]


def test_a_sentencepiece_gguf_takes_a_text_and_a_tokens_own_string(tmp_path):
    tokens = SPM + [f"w{i}" for i in range(40)]
    path, _ = write_gguf(tmp_path / "spm.gguf", "llama", tokens, scores=[0, 0, 0, -1, -5, -5, -5, -2, -2, -3, -6]
                         + [-9] * 40)
    for query in (" Paris", "▁Paris", "3"):  # a text, the token's exact string, its id: one token, id 3
        found = table_of(run_compare("--model", path, "--query", query, "--json", "-"))
        assert [q["id"] for q in found["queries"]] == [3] and found["queries"][0]["token"] == "▁Paris", query
    assert found["row_scale"] is None  # llama.cpp reads llama's rows as stored
    done = run_compare("--model", path, "--query", " Paris king")
    assert refused(done, "makes 2 tokens", "▁Paris", "▁king")


def test_gemmas_rows_are_scaled_as_llama_cpp_scales_them(tmp_path):
    path, _ = write_gguf(tmp_path / "g.gguf", "gemma3", SPM + [f"w{i}" for i in range(40)], width=64)
    done = run_compare("--model", path, "--query", "3", "--json", "-")
    assert table_of(done)["row_scale"] == float(np.float32(np.sqrt(64)))
    line = next(c["detail"] for c in json.loads(done.stdout)["checks"] if c["name"] == "row_scale")
    assert "llama.cpp multiplies architecture gemma3's looked-up rows by 8 (= sqrt(width)" in line


def test_a_wordpiece_gguf_and_an_ambiguous_query(tmp_path):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "paris", "king", "##is", "#", "is", "water"] + [f"w{i}" for i in
                                                                                                   range(40)]
    path, _ = write_gguf(tmp_path / "bert.gguf", "bert", tokens, model="bert")
    assert [q["id"] for q in table_of(run_compare("--model", path, "--query", "Paris", "--json", "-"))["queries"]] \
        == [4]  # lower-cased, as the uncased vocabulary reads it
    done = run_compare("--model", path, "--query", "##is")  # the token "##is" (6), or the text "##is": #, #, is
    assert refused(done, "ambiguous", "6", "7, 7, 8")


def test_a_tokenizer_json_that_pads_makes_one_token_of_a_word(tmp_path):
    """all-MiniLM-L6-v2's tokenizer.json pads to 128: a query made 128 tokens before."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "paris", "king", "water"] +
                                        [f"w{i}" for i in range(57)])}
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.enable_padding(length=128, pad_id=0, pad_token="[PAD]")
    tokenizer.enable_truncation(max_length=128)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    graphs.save(graphs.tied_logits(graphs.make_table(64, 16, 3)), tmp_path / "model.onnx")
    found = table_of(run_compare("--model", tmp_path / "model.onnx", "--query", " paris", "--json", "-"))
    assert [(q["id"], q["token"]) for q in found["queries"]] == [(4, "paris")]


def magikarp(table, reference):
    """Land & Bartolo's indicator, computed here another way: numpy's SVD of the centred table for the first
    principal component, the component projected out of every centred row, cosine to the reference rows' mean."""
    centred = table.astype(np.float64) - table.astype(np.float64).mean(axis=0)
    component = np.linalg.svd(centred, full_matrices=False)[2][0]
    rest = centred - np.outer(centred @ component, component)
    target = rest[reference].mean(axis=0)
    return rest @ target / (np.linalg.norm(rest, axis=1) * np.linalg.norm(target))


def test_under_trained_tokens_are_the_rows_that_look_like_the_unused_ones(tmp_path):
    rng = np.random.default_rng(1)
    vocab, width = 500, 32
    tokens = [f"w{i}" for i in range(vocab)]
    unused, never = list(range(400, 430)), [17, 123, 250]
    for j, i in enumerate(unused):
        tokens[i] = f"<unused{j}>"
    table = rng.standard_normal((vocab, width)).astype(np.float32)
    direction = rng.standard_normal(width)
    for i in unused + never:  # what initialisation and decay leave: one small direction, a little noise
        table[i] = 0.02 * direction + 0.002 * rng.standard_normal(width)
    path, _ = write_gguf(tmp_path / "u.gguf", "llama", tokens, table=table)
    found = table_of(run_compare("--model", path, "--query", "0", "--json", "-"))["under_trained"]
    expected = magikarp(table, unused)
    threshold = np.percentile(expected[unused], 5)
    passing = sorted(set(np.flatnonzero(expected >= threshold)) - set(unused))
    assert found["reference"]["count"] == len(unused) and abs(found["threshold"] - threshold) < 1e-6
    assert sorted(c["id"] for c in found["candidates"]) == passing == sorted(never)
    for c in found["candidates"]:  # float64 both ways: eigh of the Gram matrix against an SVD
        assert abs(c["score"] - expected[c["id"]]) < 1e-6
        assert abs(c["norm"] - np.linalg.norm(table[c["id"]].astype(np.float64))) < 1e-6


def test_without_unused_tokens_no_indicator_and_the_default_rows_say_why(tmp_path):
    path, _ = write_gguf(tmp_path / "plain.gguf", "llama", [f"w{i}" for i in range(60)], model="none")
    done = run_compare("--model", path)
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())  # the report's wrapped lines, joined
    assert "no --query given and no tokenizer to make ' Paris', ' king', ' water' tokens: the lists below are of " \
           "the rows of median, shortest and longest length" in said
    assert "under-trained: not looked for: the vocabulary marks no token unused or reserved" in said
    assert all(len(line) <= 120 for line in done.stdout.splitlines())
