"""A transformers.js folder holds one model per dtype variant (issue 48): inspect reports each variant as its own
client load (from the root and from onnx/ alike, nothing counted across variants), --dtype picks one, and --retie OUT
writes every variant back in transformers.js's layout, which transformers.js itself loads at each dtype and greedy-
decodes as the original folder does."""
import json
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from runtime.model.read.layout import client_files, variants
from tests import transformersjs_client as client
from tests.fixtures import transformersjs_gpt2
from tests.helpers import run_inspect
from tests.runtime_inspect.test_transformersjs import NEW, PROMPTS, needs_chromium, needs_node, ort_greedy, tree

DTYPES = ["fp32", "fp16", "q8", "bnb4"]  # the fixture's, in transformers.js's DEFAULT_DTYPE_SUFFIX_MAPPING order
FILES = {"fp32": "model.onnx", **{d: transformersjs_gpt2.VARIANTS[d] for d in DTYPES[1:]}}  # the variants made here


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return transformersjs_gpt2.make(str(tmp_path_factory.mktemp("tjs") / "gpt2"), dtypes=DTYPES[1:])


@pytest.fixture(scope="module")
def retied(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "retied"
    done = run_inspect(folder, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return str(out), done.stdout


def table_copies(path):
    """How many initializers of the model at `path` hold its token table's values (as stored, or transposed),
    counted with numpy: the table is the initializer the Gather of the ids reads (quantize_dynamic's uint8 codes
    dequantized with their scale and zero point, as its DequantizeLinear reads them)."""
    model = onnx.load(path)
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    values = {}
    for name, array in stored.items():
        base = name[:-len("_quantized")] if name.endswith("_quantized") else None
        if base and f"{base}_scale" in stored:
            zero = stored.get(f"{base}_zero_point", np.zeros((), array.dtype)).astype(np.float64)
            values[name] = (array.astype(np.float64) - zero) * stored[f"{base}_scale"].astype(np.float64)
        elif array.ndim == 2:
            values[name] = array.astype(np.float64)
    ids = {"input_ids"} | {o for n in model.graph.node if n.op_type == "Reshape" and n.input[0] == "input_ids"
                           for o in n.output}  # the export flattens the ids first
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[1] in ids)
    table = values[gather.input[0]]  # (512, 64)
    return sum(1 for v in values.values() if v.shape == table.shape and np.array_equal(v, table)
               or v.shape == table.T.shape and np.array_equal(v, table.T))


def inspected_json(*args):
    done = run_inspect(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# --- which files are a variant ----------------------------------------------------------------------------------

def test_variants_follow_transformersjs_suffixes(tmp_path):
    # DEFAULT_DTYPE_SUFFIX_MAPPING: q8 is _quantized; q4f16 is not q4 plus fp16; a split model's files go together
    names = ["embed_tokens.onnx", "decoder_model_merged.onnx", "decoder_model.onnx",  # fp32: the merged decoder
             "embed_tokens_q4f16.onnx", "decoder_model_merged_q4f16.onnx",
             "embed_tokens_q4.onnx", "decoder_model_merged_q4.onnx",
             "embed_tokens_quantized.onnx", "decoder_model_merged_quantized.onnx"]
    for name in names:
        os.makedirs(tmp_path / "onnx", exist_ok=True)
        (tmp_path / "onnx" / name).write_bytes(b"")
    assert variants(str(tmp_path)) is None  # no config.json: not a folder transformers.js loads
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    expected = [("fp32", ["embed_tokens.onnx", "decoder_model_merged.onnx"]),
                ("q8", ["embed_tokens_quantized.onnx", "decoder_model_merged_quantized.onnx"]),
                ("q4", ["embed_tokens_q4.onnx", "decoder_model_merged_q4.onnx"]),
                ("q4f16", ["embed_tokens_q4f16.onnx", "decoder_model_merged_q4f16.onnx"])]
    assert variants(str(tmp_path)) == [(d, [os.path.join("onnx", f) for f in fs]) for d, fs in expected]
    assert variants(str(tmp_path / "onnx")) == expected
    assert client_files(str(tmp_path), dtype="q4f16")[0] == ["onnx/embed_tokens_q4f16.onnx",
                                                             "onnx/decoder_model_merged_q4f16.onnx"]


# --- the report ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("read_from", ["root", "onnx"])
def test_each_variant_is_reported_as_its_own_client_load(folder, read_from):
    # failed before issue 48: from onnx/, the four variants were one client load, "stored 6 times"
    source = folder if read_from == "root" else os.path.join(folder, "onnx")
    found = inspected_json(source)
    assert [v["dtype"] for v in found["variants"]] == DTYPES
    assert "files" not in found and "across_files" not in found  # nothing across variants
    prefix = "onnx/" if read_from == "root" else ""
    for v in found["variants"]:
        path = os.path.join(folder, "onnx", FILES[v["dtype"]])
        assert v["files"] == [prefix + FILES[v["dtype"]]]
        assert v["file_bytes"] == os.path.getsize(path)  # no external data: the file alone
        assert v["copies_on_disk"] == table_copies(path), v["dtype"]
        assert v["copies_in_memory"] >= 1
        assert all(e["dtype"] == v["dtype"] for e in v["verdict"])
        stored = [e for e in v["verdict"] if e["kind"] == "stored_more_than_once"]
        assert [e["copies_on_disk"] for e in stored] == ([v["copies_on_disk"]] if v["copies_on_disk"] > 1 else [])
    assert found["verdict"] == [e for v in found["variants"] for e in v["verdict"]]
    assert [table_copies(os.path.join(folder, "onnx", FILES[d])) for d in DTYPES] == [2, 2, 2, 1]  # the fixture


def test_the_text_report_names_each_variant_and_lists_them(folder):
    done = run_inspect(folder, "--static", "--check")
    assert done.returncode == 1, done.stderr  # fp32, fp16 and q8 each store the table twice
    lines = done.stdout.splitlines()
    assert [line.split()[2] for line in lines if line.startswith("--check: FAIL")] == ["fp32:", "fp16:", "q8:"]
    assert all(len(line) <= 100 for line in lines)
    opening = [line for line in lines[:lines.index("")] if not line.startswith(" ")]
    named = [line.split(": ")[0].split(", ") for line in opening]  # a finding said once for the variants it holds
    assert opening and all(set(dtypes) <= set(DTYPES) for dtypes in named)
    assert {d for dtypes in named for d in dtypes} == {"fp32", "fp16", "q8"}  # bnb4's table is once: its row says
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  ") and line.split()[0] in DTYPES}
    assert list(rows) == DTYPES
    for dtype, row in rows.items():  # dtype, files, size (2 words), copies on disk, in a session
        copies = table_copies(os.path.join(folder, "onnx", FILES[dtype]))
        assert row[1] == "1" and row[4] == {1: "once", 2: "twice"}[copies] and row[5:] == ["not", "run"]


def test_static_counts_nothing_in_memory(folder):
    found = inspected_json(folder, "--static")
    assert [v["copies_in_memory"] for v in found["variants"]] == [None] * len(DTYPES)


def test_dtype_inspects_one_variant_as_a_folder(folder):
    found = inspected_json(folder, "--dtype", "q8", "--static")
    assert "variants" not in found and [f["path"] for f in found["files"]] == ["onnx/model_quantized.onnx"]
    group = next(v for v in found["across_files"]["vocabulary"] if v["kind"] == "token")
    assert group["copies_on_disk"] == table_copies(os.path.join(folder, "onnx", "model_quantized.onnx"))


@pytest.mark.parametrize("args, said", [
    (["--dtype", "q4"], "has no q4 variant"), (["--dtype", "fp8"], "not a transformers.js dtype"),
    (["--dtype", "fp16", "--files", "onnx/model.onnx"], "--files and --dtype")])
def test_dtype_refuses_what_the_folder_does_not_have(folder, args, said):
    done = run_inspect(folder, *args)
    assert (done.returncode, done.stdout) == (2, "")
    assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    if "--files" not in args:
        assert "fp32, fp16, q8, bnb4" in done.stderr  # the dtypes it has


def test_dtype_refuses_a_folder_without_variants(folder, tmp_path):
    for model in (os.path.join(folder, "onnx", "model.onnx"), tmp_path):
        done = run_inspect(model, "--dtype", "fp16")
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


# --- --retie OUT ---------------------------------------------------------------------------------------------------

def test_retie_writes_every_variant(folder, retied):
    out, said = retied
    files = sorted(FILES.values())
    assert tree(out) == ["config.json"] + sorted(f"onnx/{f}{end}" for f in files for end in ("", "_data"))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["transformers.js_config"] == {"use_external_data_format": {f: 1 for f in files}}
    values = lambda m: {t.name: numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}
    said = " ".join(said.split())
    assert "retie: fp32: written as it is" not in said and table_copies(os.path.join(out, "onnx", "model.onnx")) == 1
    for dtype, name in FILES.items():  # each variant as --retie's rules answer for it: retied, or as it was
        if f"retie: {dtype}: written as it is" in said:
            before, after = (onnx.load(os.path.join(where, "onnx", name)) for where in (folder, out))
            assert values(after) == values(before) and after.graph.node == before.graph.node, dtype
        else:
            assert table_copies(os.path.join(out, "onnx", name)) == 1, dtype
    assert "retie: bnb4: written as it is: every table held once" in said  # its head is NF4 codes, not a copy


def test_retie_out_decodes_as_the_original_in_onnxruntime(folder, retied):
    for name in ("model.onnx", "model_fp16.onnx"):  # both keep float32 inputs and outputs (keep_io_types)
        expected = ort_greedy(os.path.join(folder, "onnx", name), PROMPTS[0], NEW)
        assert ort_greedy(os.path.join(retied[0], "onnx", name), PROMPTS[0], NEW) == expected, name


@needs_node
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_transformersjs_node_loads_each_variant_of_retie_out(folder, retied, dtype):
    expected = client.node_greedy(folder, PROMPTS, NEW, dtype=dtype)["tokens"]
    if dtype in ("fp32", "fp16"):  # transformers.js's greedy = onnxruntime's on that variant's file
        assert expected == [ort_greedy(os.path.join(folder, "onnx", FILES[dtype]), p, NEW) for p in PROMPTS]
    assert client.node_greedy(retied[0], PROMPTS, NEW, dtype=dtype)["tokens"] == expected


@needs_node
@needs_chromium
@pytest.mark.slow
def test_transformersjs_browser_loads_the_fp16_variant_of_retie_out(folder, retied):
    # the browser build fetches onnx/model_fp16.onnx_data only because config.json names that file
    expected = [ort_greedy(os.path.join(folder, "onnx", "model_fp16.onnx"), p, NEW) for p in PROMPTS]
    assert client.browser_greedy(retied[0], PROMPTS, NEW, dtype="fp16")["tokens"] == expected


@pytest.mark.slow
def test_logits_to_keep_rewrites_the_variants_it_can(tmp_path):
    source = transformersjs_gpt2.make(str(tmp_path / "gpt2"), dtypes=["q8", "bnb4"])
    done = run_inspect(source, "--retie", tmp_path / "out", "--logits-to-keep", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    said = " ".join(done.stdout.split())
    assert "retie: q8: --logits-to-keep left out: the head onnx::MatMul_407_quantized is read by MatMulInteger" in said
    assert "retie: bnb4: --logits-to-keep left out: no logits head" in said
    kept = {name: "num_logits_to_keep" in {t.name for t in onnx.load(
        str(tmp_path / "out" / "onnx" / name), load_external_data=False).graph.initializer} for name in FILES.values()
        if name != "model_fp16.onnx"}
    assert kept == {"model.onnx": True, "model_quantized.onnx": False, "model_bnb4.onnx": False}


def test_retie_writes_nothing_where_no_variant_has_anything_to_rewrite(tmp_path):
    source = transformersjs_gpt2.make(str(tmp_path / "gpt2"), dtypes=["q8", "bnb4"])
    os.remove(os.path.join(source, "onnx", "model.onnx"))  # q8 holds its table twice in a form --retie leaves
    done = run_inspect(source, "--retie", tmp_path / "out")
    assert done.returncode == 0 and "retie: nothing to do" in done.stdout, done.stdout + done.stderr
    assert not os.path.exists(tmp_path / "out")
