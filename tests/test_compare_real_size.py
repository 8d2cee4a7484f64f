"""runtime.compare at GPT-2's vocabulary: the main job at a size users care about, with external data."""
import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

VOCAB, WIDTH = 50257, 768


@pytest.mark.slow
def test_compare_passes_at_gpt2_size(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "runtime.compare", "--vocab-size", str(VOCAB), "--width", str(WIDTH),
                           "--json", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:]
    assert done.stderr == ""  # progress only on a terminal
    data = json.loads(report.read_text())
    assert data["passed"] and len(data["checks"]) == 14 + 6 * 4  # float32 checks, then 6 lines per other format
    table_bytes = 4 * VOCAB * WIDTH  # float32: one table, or the rows doubling the vocabulary adds
    sizes = {c["detail"].split(":")[0]: c["values"] for c in data["checks"] if c["name"] == "sizes"}
    for claim in ("untied - tied", "tied, vocab x2"):
        measured = sizes[claim]
        assert measured["tensor_bytes"] == table_bytes
        assert measured["file_bytes"] == measured["tensor_bytes"] + measured["layout_bytes"]
    (held,) = [v for k, v in sizes.items() if k.startswith("values held == embed.param_count")]
    # at this size graphs.save writes the tables as external data aligned to 64 KiB: layout includes the padding
    assert held[f"{VOCAB}_tied"]["file_bytes"] - held[f"{VOCAB}_tied"]["tensor_bytes"] < 2 * 65536 + 4096
