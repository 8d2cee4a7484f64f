"""Netron, for real: exported graphs served by `graphs.export DIR --netron` until Ctrl-C, and served by the netron
package and rendered in headless Chromium."""
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from graphs.export import FILES
from graphs.export import main as export
from tests import netron_view
from tests.helpers import ROOT

if not netron_view.chromium() and os.environ.get("CI"):
    raise RuntimeError("chromium is missing on CI: .ci/run should have installed it")
needs_chromium = pytest.mark.skipif(not netron_view.chromium(), reason="no chromium on this machine (apt-get install "
                                                                       "chromium)")


def _served(process):
    """{url: path} from the lines `--netron` prints, read until it says it is serving."""
    urls = {}
    for line in process.stdout:
        found = re.match(r"netron: (http://\S+)  (\S+)$", line.rstrip("\n"))
        if found:
            urls[found.group(1)] = found.group(2)
        if line.startswith("serving until Ctrl-C"):
            return urls
    raise AssertionError(f"--netron ended before serving: {process.stderr.read()}")


def test_export_netron_serves_every_graph_until_ctrl_c(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "graphs.export", str(tmp_path), "--vocab-size", "64", "--width",
                                "8", "--netron", "--port", "0"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # (a background job, as a CI step may be, inherits SIGINT ignored: Ctrl-C is what this test sends)
    try:
        urls = _served(process)
        assert sorted(os.path.basename(p) for p in urls.values()) == sorted(FILES)
        for url, path in urls.items():  # each address serves Netron's page, which names the model it loads
            page = urllib.request.urlopen(url, timeout=30).read().decode()
            assert "<title>Netron</title>" in page
            model = re.search(r'<meta name="file" content="([^"]+)">', page).group(1)
            with open(path, "rb") as f:  # and that model is the file written
                assert urllib.request.urlopen(url + model, timeout=30).read() == f.read()
        assert process.poll() is None  # still serving
    finally:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0 and out == "netron: stopped\n" and err == "", err
    with pytest.raises(OSError):  # the servers went with it
        urllib.request.urlopen(next(iter(urls)), timeout=5)


def test_export_netron_refuses_a_taken_port_before_writing(tmp_path):
    import socket
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "graphs.export", str(tmp_path / "out"), "--netron", "--port",
                               str(port - 2)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"python -m graphs.export: error: --port: localhost:{port} cannot be listened on")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@needs_chromium
def test_netron_renders_the_exported_graphs(tmp_path):
    assert export([str(tmp_path), "--vocab-size", "64", "--width", "8"]) == 0
    names = ["tied_logits", "onehot_lookup", "neighbors_dot"]
    shots = [tmp_path / f"{n}.png" for n in names]
    labels = ("Reshape", "Gather", "FusedMatMul", "Gemm", "OneHot", "MatMul", "TopK")
    tied, onehot, neighbors = netron_view.render([tmp_path / f"{n}.onnx" for n in names], shots, labels)
    # labels match as substrings: the FusedMatMul node also counts as a MatMul; the Reshapes are the tie's view
    # and the one that flattens its anchor (graphs.tie)
    assert tied == {"Reshape": 2, "Gather": 1, "FusedMatMul": 1, "Gemm": 0, "OneHot": 0, "MatMul": 1, "TopK": 0}
    assert onehot == {"Reshape": 0, "Gather": 0, "FusedMatMul": 0, "Gemm": 0, "OneHot": 1, "MatMul": 1, "TopK": 0}
    assert neighbors == {"Reshape": 2, "Gather": 1, "FusedMatMul": 0, "Gemm": 1, "OneHot": 1, "MatMul": 0, "TopK": 1}
    for shot in shots:  # a PNG with something drawn in it
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000


@needs_chromium
def test_netron_renders_a_quantized_tied_head(tmp_path):
    assert export([str(tmp_path), "--vocab-size", "64", "--width", "32", "--format", "int4", "--block-size", "16"]) == 0
    labels = ("GatherBlockQuantized", "MatMulNBits", "DequantizeLinear", "FusedMatMul")
    (tied,) = netron_view.render([tmp_path / "tied_logits.onnx"], [tmp_path / "tied.png"], labels)
    # the one int4 table, in onnxruntime's block layout, feeds the row lookup and the head itself: nothing decodes it
    assert tied == {"GatherBlockQuantized": 1, "MatMulNBits": 1, "DequantizeLinear": 0, "FusedMatMul": 0}
    assert (tmp_path / "tied.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
