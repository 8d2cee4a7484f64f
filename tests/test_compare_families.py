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

# a SentencePiece vocabulary as Gemma's GGUF scores it: minus each piece's rank, so that a Unigram (the sum of the
# pieces' scores) would split " Paris" into ▁P, ar, is, where llama.cpp merges pairs by the joined piece's score
SPM = ["<unk>", "<s>", "</s>", "▁", "P", "a", "r", "i", "s", "k", "n", "g", "w", "t", "e", "is", "ar", "▁P", "in",
       "▁k", "▁Par", "▁kin", "▁king", "▁Paris", "Paris", "Par"]
SPM_SCORES = [0, 0, 0] + [-1000 - i for i in range(3, 15)] + [-17, -22, -99, -30, -120, -300, -400, -500, -8585,
                                                              -9000, -9500]


def write_gguf(path, architecture, tokens, model="llama", table=None, width=16, scores=None, merges=None):
    """A GGUF file holding a float32 token table (random, seed 0, unless given) and its vocabulary (its merges for a
    `gpt2` model)."""
    table = np.random.default_rng(0).standard_normal((len(tokens), width)).astype(np.float32) if table is None \
        else table
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores([float(s) for s in scores])
    if merges is not None:
        writer.add_token_merges(merges)
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
    path, _ = write_gguf(tmp_path / "spm.gguf", "llama", tokens, scores=SPM_SCORES + [-20000] * 40)
    paris = SPM.index("▁Paris")
    for query in (" Paris", "▁Paris", str(paris)):  # a text, the token's exact string, its id: one token
        found = table_of(run_compare("--model", path, "--query", query, "--json", "-"))
        assert [q["id"] for q in found["queries"]] == [paris] and found["queries"][0]["token"] == "▁Paris", query
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


def encoder(path, vocab=30, positions=20, types=2, width=16):
    """A BERT-shaped embedding front: word, position and token-type tables looked up by three id inputs and summed;
    no head (a feature extractor)."""
    from onnx import TensorProto, helper, numpy_helper, save
    rng = np.random.default_rng(2)
    tables = {"word": vocab, "position": positions, "token_type": types}
    inits = [numpy_helper.from_array(rng.standard_normal((n, width)).astype(np.float32), f"{name}_embeddings")
             for name, n in tables.items()]
    inputs = {"word": "input_ids", "position": "position_ids", "token_type": "token_type_ids"}
    nodes = [helper.make_node("Gather", [f"{name}_embeddings", inputs[name]], [f"{name}_rows"]) for name in tables]
    nodes += [helper.make_node("Add", ["word_rows", "position_rows"], ["partial"]),
              helper.make_node("Add", ["partial", "token_type_rows"], ["last_hidden_state"])]
    graph = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info(i, TensorProto.INT64, [1, "sequence"])
                                                 for i in inputs.values()],
                              [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, None)], inits)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path / "model.onnx"))
    (path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": vocab}))
    return path / "model.onnx"


def test_an_encoders_token_table_is_the_vocabularys_and_it_has_no_head(tmp_path):
    """all-MiniLM-L6-v2's front: refused before with "3 token tables"; its word table is the one config.json's
    vocab_size names, the others are named, and no head is claimed."""
    encoder(tmp_path)
    done = run_compare("--model", tmp_path, "--query", "3", "--json", "-")
    found = table_of(done)
    assert (found["name"], found["vocab_size"], found["tied"], found["head"]) == ("word_embeddings", 30, False, None)
    line = next(c["detail"] for c in json.loads(done.stdout)["checks"] if c["name"] == "table")
    assert "no head scores tokens" in line and "token_type_embeddings" in line


def test_a_bad_query_is_answered_before_the_table_is_read(tmp_path, monkeypatch, capsys):
    from runtime.compare import cli
    from runtime.compare.real import source
    path, _ = write_gguf(tmp_path / "spm.gguf", "llama", SPM + [f"w{i}" for i in range(40)])

    def never(table):
        raise AssertionError("the table was read")
    monkeypatch.setattr(source.Table, "read", never)
    assert cli.main(["--model", str(path), "--query", " Paris king"]) == 2
    assert "makes 2 tokens" in capsys.readouterr().err
    assert cli.main(["--model", str(path), "--query", "3", "--ids", "1,66"]) == 2  # 66 rows: ids 0..65
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m runtime.compare: error: --ids: 66 is out of range [0, 66) (the table's rows)"]


def test_a_damaged_gguf_header_is_one_line_never_a_traceback(tmp_path):
    """gguf_header reads untrusted bytes: every truncation and 300 single-byte changes of a small file's header give
    a Table or an InspectError, never another exception (or a hang: each length is checked against the file)."""
    from runtime.compare.real.source import find_table
    from runtime.model.read.text import InspectError
    path, _ = write_gguf(tmp_path / "ok.gguf", "gemma3", SPM + [f"w{i}" for i in range(40)],
                         scores=SPM_SCORES + [-20000] * 40)
    good = path.read_bytes()
    header = good.index(b"token_embd.weight") + 64  # the metadata and the tensor infos, a little past them
    rng = np.random.default_rng(0)
    damaged = [good[:n] for n in range(0, header, 7)]
    for at, value in zip(rng.integers(0, header, 300), rng.integers(0, 256, 300)):
        damaged.append(good[:at] + bytes([value]) + good[at + 1:])
    outcomes = {"read": 0, "refused": 0}
    for number, data in enumerate(damaged):
        bad = tmp_path / f"bad{number}.gguf"
        bad.write_bytes(data)
        try:
            find_table(str(bad)).read()
            outcomes["read"] += 1
        except InspectError:
            outcomes["refused"] += 1
        bad.unlink()
    assert outcomes["refused"] >= len(range(0, header, 7)) - 1 and sum(outcomes.values()) == len(damaged)
