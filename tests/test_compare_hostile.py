"""compare --model on untrusted material past its readers (issue 63): odd but valid tables, hostile vocabularies and
queries. Each case holds a promise the command broke before: one line and exit 2 (or a true answer), never a
traceback or a hang, and nothing from a file forging a line of the report. The GGUF files are written here with the
gguf package's own writer."""
import json
import math
import time

import numpy as np
import pytest

from reference.scores import lead_factor
from tests.helpers import refused
from tests import test_compare_families as families
from tests.test_compare_model import run_compare

gguf = pytest.importorskip("gguf")

WORDS = [f"w{i}" for i in range(40)]


def write_gguf(path, tokens, table=None, model="llama", architecture="llama", merges=None):
    """test_compare_families.write_gguf's file (a float32 table of width 16, random unless given), its path."""
    return families.write_gguf(path, architecture, tokens, model=model, table=table, merges=merges)[0]


@pytest.mark.parametrize("value, said", [(np.inf, "+inf"), (-np.inf, "-inf"), (np.nan, "NaN")])
def test_a_non_finite_value_is_refused_naming_its_row(tmp_path, value, said):
    table = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    table[7, 3] = value
    table[9, 0] = np.inf  # a later row: the first is named
    started = time.monotonic()
    done = run_compare("--model", write_gguf(tmp_path / "bad.gguf", WORDS, table), "--query", "0", timeout=120)
    assert refused(done, "row 7", said, "column 3", "finite"), done.stderr
    assert time.monotonic() - started < 60 and "RuntimeWarning" not in done.stderr


def test_a_one_row_vocabulary_is_refused(tmp_path):
    done = run_compare("--model", write_gguf(tmp_path / "one.gguf", ["only"]), "--query", "0", timeout=120)
    assert refused(done, "1 row", "no other token"), done.stderr


def test_lead_factor_ends_on_non_finite_scores():
    assert lead_factor([1.0, math.inf, 2.0], 0, 2) is None  # doubled forever before
    assert lead_factor([1.0, 3.0, math.nan], 0, 2) is None
    assert lead_factor([1.0, 3.0, 2.0], 0, 2) == 2.0  # 4 > 3: the rule itself unchanged


@pytest.mark.parametrize("query", ["²", "٣"])
def test_only_ascii_digits_are_an_id(tmp_path, query):
    done = run_compare("--model", write_gguf(tmp_path / "v.gguf", WORDS), "--query", query, timeout=120)
    assert refused(done, "--query"), done.stderr  # a text the vocabulary does not hold, said in one line


def test_a_token_from_the_file_never_starts_a_line_and_a_long_one_is_cut(tmp_path):
    tokens = ["forged\nFORGED | a line of its own", "\x1b[2Jesc", "x" * 5000] + WORDS
    architecture = "\x1b]0;title\x07" + "a" * 100000
    path = write_gguf(tmp_path / "v.gguf", tokens, architecture=architecture)
    done = run_compare("--model", path, "--query", "0,1,2", timeout=300)
    assert done.returncode in (0, 1), done.stderr
    lines = done.stdout.splitlines()
    assert not any(line.startswith("FORGED") for line in lines)
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert max(map(len, lines)) < 400 and "(5000 characters)" in done.stdout


def test_a_gpt2_merge_the_vocabulary_lacks_is_one_line_naming_the_key(tmp_path):
    tokens = ["a", "b", "ab"] + WORDS
    path = write_gguf(tmp_path / "m.gguf", tokens, model="gpt2", merges=["a b", "q z"])
    done = run_compare("--model", path, "--query", "0", timeout=120)
    assert refused(done, "tokenizer.ggml.merges"), done.stderr


def test_a_huge_sentencepiece_token_does_not_hang_the_rebuild(tmp_path):
    tokens = ["<unk>", "▁", "a", "b"] + ["ab" * 500000] + WORDS  # 1 MB: every split of it was tried
    started = time.monotonic()
    done = run_compare("--model", write_gguf(tmp_path / "s.gguf", tokens), "--query", "2", timeout=300)
    assert done.returncode in (0, 1), done.stderr
    assert time.monotonic() - started < 60


def test_a_tokenizer_in_a_parent_the_user_did_not_name_is_not_read(tmp_path):
    import graphs
    from tests.test_compare_model import tokenizer
    folder = tmp_path / "model"
    folder.mkdir()
    graphs.save(graphs.tied_logits(graphs.make_table(60, 16, 3)), folder / "model.onnx")
    tokenizer(tmp_path, [f"secret{i}" for i in range(60)])  # tokenizer.json in the parent: not the model's
    done = run_compare("--model", folder, "--query", "5", "--json", "-", timeout=300)
    assert done.returncode in (0, 1), done.stderr
    assert "secret" not in done.stdout + done.stderr


def test_verify_without_candidates_says_so():
    from runtime.compare.real import verify
    answer = verify.verify(None, None, [], 2)  # nothing is opened or run for no candidates
    assert answer["checked"] == 0 and verify.line(answer) == (
        "under-trained: not verified: no candidates to put to the model (the indicator found none)")


def test_feeds_past_their_bound_are_refused_not_allocated():
    from onnx import TensorProto, helper
    from runtime.feeds import NoFeeds, shaped_feeds
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"]),
                               helper.make_tensor_value_info("extra", TensorProto.FLOAT, [65536, 65536])],
                              [helper.make_tensor_value_info("logits", TensorProto.INT64, None)])
    with pytest.raises(NoFeeds, match="extra"):
        shaped_feeds(helper.make_model(graph), {"input_ids": 10}, {"past": 0, "head_size": None}, 3)


def test_an_all_zero_row_is_a_finding_left_out_of_the_cosine_lists(tmp_path):
    """Padding rows are often zero: their cosine is 0/0. They are named, left out of every cosine list (the graph's and
    embed's alike, so the check still compares them), and refused as a query, in one line."""
    table = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    table[[5, 17]] = 0.0
    path = write_gguf(tmp_path / "z.gguf", WORDS, table)
    done = run_compare("--model", path, "--query", "0", "--k", "39", "--json", "-", timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    (cosine,) = [c for c in data["checks"] if c["graph"] == "neighbors_cosine"]
    unit = table.astype(np.float64)
    lengths = np.linalg.norm(unit, axis=1)
    others = [t for t in range(40) if t not in (0, 5, 17)]
    cos = {t: unit[t] @ unit[0] / (lengths[t] * lengths[0]) for t in others}
    assert cosine["passed"] and cosine["values"]["indices"] == sorted(others, key=lambda t: (-cos[t], t))  # 37 only
    (dot,) = [c for c in data["checks"] if c["graph"] == "neighbors_dot"]
    assert len(dot["values"]["indices"]) == 39  # a zero row has a dot product, 0
    (zero,) = [c for c in data["checks"] if c["name"] == "zero_rows"]
    assert "2 all-zero rows (padding rows: w5, w17)" in zero["detail"]
    assert refused(run_compare("--model", path, "--query", "5", timeout=120), "--query 5", "all zeros")


def test_an_argument_that_is_not_utf8_is_one_line(tmp_path):
    import subprocess
    import sys
    from tests.helpers import ROOT
    path = write_gguf(tmp_path / "v.gguf", WORDS)
    done = subprocess.run([sys.executable, "-m", "runtime.compare", "--model", str(path), "--query", b"w\xff"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused(done, "not UTF-8"), done.stderr


def test_a_row_whose_length_overflows_float32_is_refused_without_warnings(tmp_path):
    table = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    table[11, 2] = 3e19  # finite in float32; its square is not
    done = run_compare("--model", write_gguf(tmp_path / "big.gguf", WORDS, table), "--query", "0", timeout=120)
    assert refused(done, "row 11", "overflows float32"), done.stderr
    assert "Warning" not in done.stderr


def test_a_tokenizer_linked_to_a_file_of_the_same_folder_is_read(tmp_path):
    import os
    import graphs
    from tests.test_compare_model import tokenizer
    folder = tmp_path / "model"
    folder.mkdir()
    graphs.save(graphs.tied_logits(graphs.make_table(60, 16, 3)), folder / "model.onnx")
    tokenizer(folder, [f"word{i}" for i in range(60)])
    os.rename(folder / "tokenizer.json", folder / "real.json")
    os.symlink("real.json", folder / "tokenizer.json")  # stays inside: read as the file it names (refused before)
    done = run_compare("--model", folder, "--query", "word5", "--json", "-", timeout=300)
    assert done.returncode in (0, 1), done.stderr
    assert "word5" in done.stdout
