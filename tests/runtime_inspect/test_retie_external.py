"""--retie on an export whose one data file holds every tensor, a Constant's value too (issue 47: Optimum saves an
export past 2 GiB so, and Qwen2.5's inv_freq Constant, onnx::Expand_431, lies in model.onnx_data): OUT names only
files it holds, and runs with the original's folder gone."""
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx.external_data_helper import convert_model_to_external_data, set_external_data

from runtime.inspect import cli
from runtime.inspect.retie import edits
from runtime.feeds import feeds_for
from runtime.model.read.model import all_tensors, graph_paths
from tests.helpers import FIXTURES, FOLDERS, VOCAB, inspected, one_line_error
from tests.runtime_inspect.test_retie import logits_against_exact


def one_data_file(source, folder):
    """Each model file of folder `source` saved into `folder` as Optimum saves a large export: every initializer
    (size threshold 0) and each float Constant's value (as its threshold puts inv_freq there) in one
    `<file>_data`; the other files copied."""
    os.makedirs(folder)
    for name in sorted(os.listdir(source)):
        if not name.endswith(".onnx"):
            shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))
            continue
        model = onnx.load(os.path.join(source, name))
        convert_model_to_external_data(model, location=name + "_data", size_threshold=0)
        for _, _, graph in graph_paths(model.graph):  # in If branches too
            for node in graph.node:
                value = node.attribute[0].t if node.op_type == "Constant" else None
                if value is not None and value.data_type == TensorProto.FLOAT:  # never a shape onnxruntime reads
                    set_external_data(value, name + "_data")
        onnx.save_model(model, os.path.join(folder, name))
        assert len(data_files(os.path.join(folder, name), nested=True)) == 1  # the layout, Constants and all


def data_files(path, nested=False):
    """The files the external tensors of the model at `path` name (main graph, subgraphs, attributes, functions),
    as paths relative to its folder; `nested`: only those outside the main graph's initializers."""
    model = onnx.load(path, load_external_data=False)
    return {e.value for t, top in all_tensors(model.graph, model.functions)
            if t.data_location == TensorProto.EXTERNAL and not (nested and top)
            for e in t.external_data if e.key == "location"}


def names_only_its_own(model_path, written):
    """Every external tensor of the model at `model_path` names a file in `written` (the paths --retie wrote)."""
    folder = os.path.dirname(model_path)
    named = {os.path.normpath(os.path.join(folder, location)) for location in data_files(model_path)}
    assert named and named <= {os.path.normpath(p) for p in written}, (model_path, named, written)


def other_outputs_bit_for_bit(source, out, vocab=VOCAB):
    """Every output but the logits of the two models, on the same decoder feeds (ids below `vocab`), bit for bit."""
    original = onnx.load(source)  # its data read in: the original runs from memory
    feeds = feeds_for(original, {"input_ids": vocab}, np.random.default_rng(3))
    names = [o.name for o in original.graph.output if o.name != "logits"]
    before = ort.InferenceSession(original.SerializeToString()).run(names, feeds)
    after = ort.InferenceSession(str(out)).run(names, feeds)
    assert len(before) == len(after) == len(names)
    for name, a, b in zip(names, before, after):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and np.array_equal(a.view(np.uint8), b.view(np.uint8)), name


def retied_alone(source, out, moved):
    """OUT (a file) against the original once the original's folder is renamed to `moved`: OUT's logits within
    float32's bound of hidden @ table^T, every other output bit for bit."""
    os.rename(os.path.dirname(source), moved)
    source = os.path.join(moved, os.path.basename(source))
    head = "onnx::MatMul_407"  # optimum_gpt2's head: transformer.wte.weight transposed (test_findings.py)
    logits_against_exact(source, out, head, lambda w: w.T, {"input_ids": VOCAB}, head_size=None)
    other_outputs_bit_for_bit(source, out)


def test_retie_folder_with_one_data_file_is_self_contained(tmp_path):
    source = tmp_path / "export"
    one_data_file(os.path.join(FIXTURES, "optimum_gpt2"), source)
    out = tmp_path / "retied"
    inspected(source, "--retie", out)
    written = [os.path.join(out, name) for name in os.listdir(out)]
    names_only_its_own(os.path.join(out, "model.onnx"), written)
    retied_alone(str(source / "model.onnx"), os.path.join(out, "model.onnx"), tmp_path / "gone")


@pytest.mark.parametrize("beside", [False, True])  # beside: the original's model.onnx_data would still resolve
def test_retie_file_with_one_data_file_is_self_contained(beside, tmp_path):
    source = tmp_path / "export"
    one_data_file(os.path.join(FIXTURES, "optimum_gpt2"), source)
    out = (source if beside else tmp_path) / "retied.onnx"
    before = set(os.listdir(out.parent))
    inspected(source / "model.onnx", "--retie", out)
    written = [os.path.join(out.parent, name) for name in set(os.listdir(out.parent)) - before]
    names_only_its_own(str(out), written)
    if beside:  # OUT stays where it was written; the original's own files go
        for name in ("model.onnx", "model.onnx_data"):
            os.rename(source / name, tmp_path / name)
        logits_against_exact(str(tmp_path / "model.onnx"), out, "onnx::MatMul_407", lambda w: w.T,
                             {"input_ids": VOCAB}, head_size=None)
        other_outputs_bit_for_bit(str(tmp_path / "model.onnx"), out)
    else:
        retied_alone(str(source / "model.onnx"), out, tmp_path / "gone")


def test_retie_merged_folder_with_one_data_file_per_file_is_self_contained(tmp_path):
    # Constants inside the If branches of decoder_model_merged.onnx lie in its data file too; a 256-token vocabulary
    source = tmp_path / "export"
    one_data_file(os.path.join(FOLDERS, "optimum_gpt2_legacy_merged"), source)
    out = tmp_path / "retied"
    inspected(source, "--retie", out)
    written = [os.path.join(out, name) for name in os.listdir(out)]
    os.rename(source, tmp_path / "gone")
    names = [name for name in os.listdir(out) if name.endswith(".onnx")]  # the files the client loads
    assert "decoder_model_merged.onnx" in names
    for name in names:
        names_only_its_own(os.path.join(out, name), written)
        other_outputs_bit_for_bit(str(tmp_path / "gone" / name), os.path.join(out, name), vocab=256)  # loads alone


@pytest.mark.parametrize("most, refused", [(35, True), (36, False)])
def test_nested_tensors_past_what_a_model_file_holds_are_refused(most, refused, tmp_path, monkeypatch, capsys):
    source = tmp_path / "export"
    one_data_file(os.path.join(FIXTURES, "optimum_gpt2"), source)  # 9 float32 Constants of one value: 36 bytes
    monkeypatch.setattr(edits, "INLINE_MOST", most)
    out = tmp_path / "retied.onnx"
    status = cli.main([str(source / "model.onnx"), "--retie", str(out)], supervised=False)
    printed = capsys.readouterr()
    if refused:
        assert one_line_error(status, printed.err, "36 bytes of Constant values and subgraph initializers",
                              "nothing written"), printed.err
        assert sorted(os.listdir(tmp_path)) == ["export"]
    else:
        assert status == 0 and data_files(str(out)) == {"retied.onnx.data"}, printed.out + printed.err
