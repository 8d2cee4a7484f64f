"""runtime.bench.folders on a shipped fixture folder: the figures of one run (the table stored and held before and
after --retie, the bytes on disk), and the Markdown region it rewrites."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import FIXTURES, ROOT

SPLIT = os.path.join(FIXTURES, "folders", "split_gpt2")


def run(*args):
    return subprocess.run([sys.executable, "-m", "runtime.bench.folders", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_split_folder_before_and_after_its_retie(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- bench:folders -->\nSTALE ROWS\n<!-- /bench -->\nafter\n")
    done = run(SPLIT, "--json", "--markdown", page)
    assert done.returncode == 0, done.stderr
    (result,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert result["copies_on_disk"] == [2, 1] and result["copies_in_memory"] == [2, 1]
    # what the client loads of the export: its two files, every byte of them (the table stored twice)
    exported = sum(os.path.getsize(os.path.join(SPLIT, f)) for f in ("embed_tokens.onnx", "decoder_model.onnx"))
    assert result["disk_bytes"][0] == exported and result["disk_bytes"][1] < exported - 256 * 32 * 4 * 0.9
    assert result["inspect_s"] > 0 and result["sessions_s"] > 0
    text = page.read_text()
    assert text.startswith("before\n<!-- bench:folders -->\n| folder |") and text.endswith("<!-- /bench -->\nafter\n")
    assert "| split_gpt2 | 256 x 32 float32 |" in text and "onnxruntime 1.32.0" in text and "STALE ROWS" not in text


def test_a_page_without_the_region_is_refused_before_measuring(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("no region here\n")
    done = run(SPLIT, "--markdown", page)
    assert done.returncode == 2 and "no <!-- bench:folders -->" in done.stderr and done.stderr.count("\n") <= 3
    assert page.read_text() == "no region here\n" and done.stdout == ""
