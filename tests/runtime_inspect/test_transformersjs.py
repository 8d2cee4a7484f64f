"""--retie OUT on a transformers.js folder (issue 48): OUT is a transformers.js folder (onnx/<file>.onnx_data,
config.json's use_external_data_format), and transformers.js itself, in Node and in its browser build in headless
Chromium, generates the same greedy tokens from OUT as from the original, with and without --logits-to-keep 1."""
import json
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from graphs.together import chunk_names, save_together
from runtime.inspect.retie import transformersjs
from runtime.model.read.layout import client_files, transformersjs_root
from tests import transformersjs_client as client
from tests.fixtures import transformersjs_gpt2
from tests.helpers import run_inspect

PROMPTS = [[1, 2, 3, 4], [100, 200, 300, 400]]
NEW = 8
needs_node = pytest.mark.skipif(not (client.node() and shutil.which("npm")), reason="no node / npm on this machine")
if not client.chromium() and os.environ.get("CI"):
    raise RuntimeError("chromium is missing on CI: .ci/run should have installed it")
needs_chromium = pytest.mark.skipif(not client.chromium(), reason="no chromium on this machine (apt-get install "
                                                                  "chromium)")


def tree(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def retied(source, out, *flags):
    done = run_inspect(source, "--retie", out, *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def ort_greedy(path, prompt, new):
    """Greedy new tokens of the Optimum GPT-2 decoder in onnxruntime, past key values fed back: what
    transformers.js's generate computes, done here independently."""
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    heads, size = 4, 16  # the fixture's n_head and n_embd / n_head
    past = {n: np.zeros((1, heads, 0, size), np.float32) for n in ("past_key_values.0.key", "past_key_values.0.value")}
    ids, tokens, done = list(prompt), [], 0
    for _ in range(new):
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, done + len(ids)), np.int64),
                 "position_ids": np.arange(done, done + len(ids), dtype=np.int64)[None], **past}
        logits, key, value = session.run(["logits", "present.0.key", "present.0.value"], feeds)
        done += len(ids)
        ids = [int(np.argmax(logits[0, -1]))]  # (1, seq, vocab) -> the last position's best
        tokens.append(ids[0])
        past = {"past_key_values.0.key": key, "past_key_values.0.value": value}
    return tokens


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"original", "retied", "kept"}: the fixture folder, its --retie OUT and its --retie OUT --logits-to-keep 1."""
    where = tmp_path_factory.mktemp("tjs")
    original = transformersjs_gpt2.make(str(where / "gpt2"))
    retied(original, where / "retied")
    retied(original, where / "kept", "--logits-to-keep", "1")
    return {"original": original, "retied": str(where / "retied"), "kept": str(where / "kept")}


# --- what OUT holds ------------------------------------------------------------------------------------------------

def check_transformersjs_out(out, source_config):
    assert tree(out) == ["config.json", "onnx/model.onnx", "onnx/model.onnx_data"]
    model = onnx.load(os.path.join(out, "onnx", "model.onnx"), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    size = os.path.getsize(os.path.join(out, "onnx", "model.onnx_data"))
    assert external  # the table among them: mapped by Node's onnxruntime, fetched by the browser build
    for tensor in external:
        where = {e.key: e.value for e in tensor.external_data}
        assert where["location"] == "model.onnx_data", tensor.name  # beside the file, the name transformers.js asks
        assert int(where["offset"]) + int(where["length"]) <= size, tensor.name
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["transformers.js_config"] == {"use_external_data_format": {"model.onnx": 1}}
    assert {k: v for k, v in config.items() if k != "transformers.js_config"} == source_config
    assert "use_external_data_format" not in source_config.get("transformers.js_config", {})


@pytest.mark.parametrize("read_from", ["root", pytest.param("onnx", marks=pytest.mark.slow)])
def test_retie_of_a_transformersjs_folder_writes_a_transformersjs_folder(read_from, tmp_path):
    # failed before issue 48: the root was "no .onnx file in the folder"; from onnx/, OUT was model.onnx and a shared
    # model.data that transformers.js's browser build cannot load, and no config.json
    original = transformersjs_gpt2.make(str(tmp_path / "gpt2"))
    source = original if read_from == "root" else os.path.join(original, "onnx")
    said = retied(source, tmp_path / "out")
    assert 'use_external_data_format {"model.onnx": 1}' in " ".join(said.split())
    check_transformersjs_out(tmp_path / "out", json.load(open(os.path.join(original, "config.json"))))
    loaded = onnx.load(str(tmp_path / "out" / "onnx" / "model.onnx"))  # every tensor resolves inside OUT
    names = {t.name for t in loaded.graph.initializer}
    assert transformersjs_gpt2.TABLE in names and transformersjs_gpt2.HEAD not in names  # the copy is gone
    original_tokens = ort_greedy(os.path.join(original, "onnx", "model.onnx"), PROMPTS[0], NEW)
    assert ort_greedy(str(tmp_path / "out" / "onnx" / "model.onnx"), PROMPTS[0], NEW) == original_tokens


@pytest.mark.slow
def test_retie_logits_to_keep_of_a_transformersjs_folder_writes_a_transformersjs_folder(folders):
    check_transformersjs_out(folders["kept"], transformersjs_gpt2.CONFIG)
    model = onnx.load(os.path.join(folders["kept"], "onnx", "model.onnx"), load_external_data=False)
    assert "num_logits_to_keep" in {t.name for t in model.graph.initializer}


def test_a_transformersjs_root_is_read_as_one_variant(tmp_path):
    # failed before issue 48: "no .onnx file in the folder" for a decoder-only transformers.js folder's root
    for name in ("model.onnx", "model_fp16.onnx", "model_q4.onnx"):
        os.makedirs(tmp_path / "onnx", exist_ok=True)
        (tmp_path / "onnx" / name).write_bytes(b"")
    files, rule = client_files(str(tmp_path))
    assert files == ["onnx/model.onnx"] and "one dtype variant" in rule
    assert transformersjs_root(str(tmp_path)) is None  # no config.json: not a folder transformers.js loads
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert transformersjs_root(str(tmp_path)) == (str(tmp_path), "")
    assert transformersjs_root(str(tmp_path / "onnx")) == (str(tmp_path), "onnx")


# --- the layout, from its parts --------------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [3000, 1000])
def test_save_together_chunks_each_files_data_below_the_limit(limit, tmp_path):
    # transformers.js's names: <file>_data, <file>_data_1, ...; each chunk below the limit, or one tensor that alone
    # reaches it; every tensor whole in one chunk; nothing shared across files
    import graphs
    model = graphs.untied_logits(graphs.make_table(64, 8), graphs.make_table(64, 8, 1))  # two 2048-byte tables
    written = save_together([("onnx/a.onnx", model, None), ("onnx/b.onnx", model, None)], tmp_path / "out",
                            min_external_bytes=1024, chunk_bytes=limit,
                            then=lambda w: {"config.json": json.dumps(w).encode()})
    names = [os.path.relpath(p, tmp_path / "out") for p in written]
    for file in ("onnx/a.onnx", "onnx/b.onnx"):
        assert chunk_names(names, file) == [f"{file}_data", f"{file}_data_1"]  # 2048 + 2048 would reach either limit
        assert [os.path.getsize(tmp_path / "out" / c) for c in chunk_names(names, file)] == [2048, 2048]
    assert sorted(names) == sorted(["config.json", "onnx/a.onnx", "onnx/a.onnx_data", "onnx/a.onnx_data_1",
                                    "onnx/b.onnx", "onnx/b.onnx_data", "onnx/b.onnx_data_1"])
    assert json.load(open(tmp_path / "out" / "config.json")) == [n for n in names if n != "config.json"]
    ids, hidden = np.array([[3, 63, 0]], np.int64), np.ones((1, 3, 8), np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"ids": ids, "hidden": hidden})
    for file in ("a", "b"):
        got = ort.InferenceSession(str(tmp_path / "out" / "onnx" / f"{file}.onnx")).run(None, {"ids": ids,
                                                                                            "hidden": hidden})
        assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("value, full, expected", [
    (None, "model.onnx", 0), (True, "model.onnx", 1), (3, "model_fp16.onnx", 3), ({"model.onnx": 2}, "model.onnx", 2),
    ({"model": 2}, "model_q4f16.onnx", 2), ({"model_fp16.onnx": 1}, "model.onnx", 0), ("2", "model.onnx", 2),
    ("x", "model.onnx", 0), ({"model.onnx": True, "model": 4}, "model.onnx", 1)])
def test_use_external_data_format_is_read_as_transformersjs_reads_it(value, full, expected):
    # resolveExternalDataFormat: the file's own entry, then its session's (`model` for model_q4f16.onnx), else one
    # value for every file
    assert transformersjs.chunks(value, full) == expected


def test_use_external_data_format_is_given_per_file():
    assert transformersjs.given(None, {"model.onnx": 1}) == {"model.onnx": 1}
    assert transformersjs.given(True, {"model.onnx": 2}) == {"model.onnx": 2}
    kept = transformersjs.given({"model_fp16.onnx": 1, "model": 3}, {"model.onnx": 0})
    assert kept == {"model_fp16.onnx": 1, "model": 3, "model.onnx": 0}  # 0 said: the session's entry says 3


# --- transformers.js itself --------------------------------------------------------------------------------------

def tokens_and_memory(run, folders):
    found = {name: run(path, PROMPTS, NEW) for name, path in folders.items()}
    print({name: {k: v for k, v in result.items() if k != "tokens"} for name, result in found.items()})
    return found


@needs_node
@pytest.mark.slow
def test_transformersjs_node_generates_the_same_tokens_after_retie(folders):
    expected = [ort_greedy(os.path.join(folders["original"], "onnx", "model.onnx"), p, NEW) for p in PROMPTS]
    found = tokens_and_memory(client.node_greedy, folders)
    assert found["original"]["tokens"] == expected  # transformers.js greedy = onnxruntime's, on the export
    assert found["retied"]["tokens"] == expected and found["kept"]["tokens"] == expected


@needs_node
@needs_chromium
@pytest.mark.slow
def test_transformersjs_browser_generates_the_same_tokens_after_retie(folders, tmp_path):
    # failed before issue 48: 'Failed to load external data file ""model.data"", error: Module.MountedFiles is not
    # available.' (a shared data file); the browser build reads onnx/model.onnx_data only when config.json says so
    expected = [ort_greedy(os.path.join(folders["original"], "onnx", "model.onnx"), p, NEW) for p in PROMPTS]
    found = tokens_and_memory(client.browser_greedy, folders)
    assert found["original"]["tokens"] == expected
    assert found["retied"]["tokens"] == expected and found["kept"]["tokens"] == expected
    unflagged = tmp_path / "unflagged"  # the same OUT without the flag: refused, so the flag is what it reads
    shutil.copytree(folders["retied"], unflagged)
    config = json.load(open(unflagged / "config.json"))
    del config["transformers.js_config"]
    (unflagged / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="external data"):
        client.browser_greedy(str(unflagged), PROMPTS[:1], 1)
