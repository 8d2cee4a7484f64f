"""runtime.bench.prefill at toy sizes: every model and prompt length runs to its end before and after
`--logits-to-keep 1`, the logits' bytes are the prompt's rows of the vocabulary, and the markdown region is written
(no timing asserted: these machines are shared)."""
import os
import subprocess
import sys

from runtime.bench import scale_model
from tests.helpers import ROOT


def test_the_prefill_bench_measures_an_exported_decoder_and_writes_its_region(tmp_path):
    path = str(tmp_path / "toy" / "model.onnx")
    os.makedirs(os.path.dirname(path))
    scale_model.generate(path, 1, vocab=300, width=16, hidden=32)
    page = tmp_path / "BENCH.md"
    page.write_text("before\n<!-- bench:prefill -->\nold\n<!-- /bench -->\nafter\n")
    done = subprocess.run([sys.executable, "-m", "runtime.bench.prefill", "--shapes", "--model", path, "--tokens",
                           "4", "64", "--markdown", str(page), "--scratch", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| toy |")]
    assert [row.split(" | ")[1] for row in rows] == ["4", "64"]
    assert [row.split(" | ")[5] for row in rows] == [f"{n * 300 * 4 / 2**20:.0f} MiB" for n in (4, 64)]
    assert "target: the head at 64 tokens <= 1.2x its cost at N = 1 after: " in done.stdout
    text = page.read_text()
    assert text.startswith("before\n<!-- bench:prefill -->\n| model |") and text.endswith("<!-- /bench -->\nafter\n")
    assert all(row in text for row in rows) and "old" not in text
    assert sorted(os.listdir(tmp_path)) == ["BENCH.md", "toy"]  # its scratch folder removed


def test_the_prefill_bench_refuses_a_page_without_its_region(tmp_path):
    page = tmp_path / "BENCH.md"
    page.write_text("no region\n")
    done = subprocess.run([sys.executable, "-m", "runtime.bench.prefill", "--markdown", str(page)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and "no <!-- bench:prefill -->" in done.stderr and "Traceback" not in done.stderr
