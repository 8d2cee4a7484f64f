"""What inspect costs on a many-layer export (issue 47): only a weight that can hold a table's values (one of a
table's vocab x width) is read and related; a layer's weights are never read. These tests time nothing: they count
the reads of each initializer."""
import collections

import onnx
import pytest

from runtime.inspect.examine import inspect_model
from runtime.inspect.examine_folder import inspect_folder
from runtime.inspect.sandbox import isolated
from runtime.model.read import model as read_model
from tests.helpers import layered

LAYERS = 12


@pytest.fixture
def reads(monkeypatch):
    """The initializers whose values or bytes the parent reads: {name: how many times}."""
    counted = collections.Counter()
    for method in ("values", "raw"):
        original = getattr(read_model.Tensor, method)

        def counting(self, _original=original):
            counted[self.name] += 1
            return _original(self)
        monkeypatch.setattr(read_model.Tensor, method, counting)
    return counted


def _layer_reads(reads):
    return {name: n for name, n in reads.items() if name.startswith("layer")}


def test_layered_folder_reads_no_layer_weight(tmp_path, reads):
    folder = tmp_path / "split"  # two files holding the same layers, as a split decoder pair does
    folder.mkdir()
    for name in ("a.onnx", "b.onnx"):
        onnx.save(layered(LAYERS), str(folder / name))
    found = inspect_folder(str(folder), None, isolated.Limits(), static=True)
    pairs = [(p["a"]["file"], p["a"]["name"], p["b"]["file"], p["b"]["name"], p["relation"])
             for p in found["across"]["pairs"]]
    assert pairs == [("a.onnx", "embedding", "b.onnx", "embedding", "duplicate"),
                     ("a.onnx", "embedding", "b.onnx", "lm_head", "transposed_duplicate")]
    assert [(p["table"], p["head"], p["relation"]) for it in found["items"] for p in it["info"]["pairs"]] \
        == [("embedding", "lm_head", "transposed_duplicate")] * 2
    assert reads["embedding"] and reads["lm_head"]  # what can hold the table is read
    assert _layer_reads(reads) == {}


def test_layered_file_reads_no_layer_weight(tmp_path, reads):
    path = str(tmp_path / "m.onnx")  # onnxruntime folds each query weight's Transpose into a copy of it
    onnx.save(layered(LAYERS), path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found = inspect_model(path, str(scratch))
    assert [(p["table"], p["head"], p["relation"]) for p in found["pairs"]] \
        == [("embedding", "lm_head", "transposed_duplicate")]
    assert len([c for c in found["runtime_copies"] if c["shape"] == [16, 16]]) == LAYERS  # the folded copies
    assert _layer_reads(reads) == {}
