"""Netron, for real: exported graphs served by the netron package and rendered in headless Chromium."""
import os

import pytest

from graphs.export import main as export
from tests import netron_view

if not netron_view.chromium():
    if os.environ.get("CI"):
        raise RuntimeError("chromium is missing on CI: .ci/run should have installed it")
    pytest.skip("no chromium on this machine (apt-get install chromium)", allow_module_level=True)


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


def test_netron_renders_a_quantized_tied_head(tmp_path):
    assert export([str(tmp_path), "--vocab-size", "64", "--width", "32", "--format", "int4", "--block-size", "16"]) == 0
    labels = ("GatherBlockQuantized", "MatMulNBits", "DequantizeLinear", "FusedMatMul")
    (tied,) = netron_view.render([tmp_path / "tied_logits.onnx"], [tmp_path / "tied.png"], labels)
    # the one int4 table, in onnxruntime's block layout, feeds the row lookup and the head itself: nothing decodes it
    assert tied == {"GatherBlockQuantized": 1, "MatMulNBits": 1, "DequantizeLinear": 0, "FusedMatMul": 0}
    assert (tmp_path / "tied.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
