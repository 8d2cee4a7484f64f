"""--retie on float16 and bfloat16 tables (issue 48): the head reads the one table through the run-time view and
its logits lie within the format's own bound of the original's, computed here in numpy: the two float32 sums of
the widened values within 2 gamma_w sum|h t| of each other, then each rounded once to the format (u = 2^-11 for
float16, 2^-8 for bfloat16, of the result; half a subnormal step below the normal range). The table is counted
once on disk from OUT's bytes, and a session's copies as inspect measures them."""
import json
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.transformers.float16 import convert_float_to_float16

import graphs
from runtime.inspect.sandbox import agree, proof
from runtime.feeds import feeds_for
from tests.helpers import FIXTURES, VOCAB, WIDTH, U, findings, model_in, one_line_error, run_inspect, unwrapped

HALF = {"float16": (2.0**-11, 2.0**-24), "bfloat16": (2.0**-8, 2.0**-133)}  # unit roundoff, subnormal spacing


def gamma(w):
    return w * U / (1 - w * U)


def rounded_bound(hidden, table, rounded, fmt):
    """How far two float32 kernels' sums of hidden @ table.T, each rounded once to `fmt`, may lie apart: |x - y| <=
    2 gamma_w sum|h t| (each sum within gamma_w of the exact one), and rounding to nearest moves a value by at most u
    of the rounded result (plus half a subnormal step), so |a - b| <= (|x - y| + 2u|a| + step) / (1 - u)."""
    u, step = HALF[fmt]
    h, t = np.abs(hidden.astype(np.float64)), np.abs(table.astype(np.float64))
    apart = 2 * gamma(t.shape[1]) * (h.reshape(-1, t.shape[1]) @ t.T).reshape(rounded.shape)
    return (apart + 2 * u * np.abs(rounded.astype(np.float64)) + step) / (1 - u)


def holding(model, table):
    """The initializers of `model` that hold `table`'s values, as stored or transposed (counted from their bytes)."""
    found = []
    for t in model.graph.initializer:
        if t.data_type != TensorProto.FLOAT16 or len(t.dims) != 2:
            continue
        values = numpy_helper.to_array(t)
        if any(values.shape == v.shape and np.array_equal(values.view(np.uint16), v.view(np.uint16))
               for v in (table, table.T)):
            found.append(t.name)
    return found


def fp16_export(tmp_path, keep_io_types):
    """Optimum's GPT-2 export converted by onnxruntime's float16 converter, as transformers.js's model_fp16.onnx
    is made: the Gather's float16 table and the head's float16 transposed copy (MatMul)."""
    path = tmp_path / "model_fp16.onnx"
    onnx.save(convert_float_to_float16(onnx.load(model_in("optimum_gpt2")), keep_io_types=keep_io_types), path)
    return path


# --- float16: an Optimum export converted, the head a float16 MatMul -------------------------------------------------

@pytest.mark.parametrize("keep_io_types", [False, True])
def test_retie_float16_export_holds_one_table_with_logits_within_float16s_bound(keep_io_types, tmp_path):
    source, out = fp16_export(tmp_path, keep_io_types), tmp_path / "retied.onnx"
    original = onnx.load(source)
    table = numpy_helper.to_array(next(t for t in original.graph.initializer if t.name == "transformer.wte.weight"))
    (head,) = [n for n in original.graph.node if n.op_type == "MatMul" and n.input[1] in holding(original, table)]
    assert len(holding(original, table)) == 2  # the premise: stored twice, the head's copy transposed
    done = run_inspect(source, "--retie", out)
    said = " ".join(unwrapped(done.stdout))
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("the logits within its float16 bound (float32's on its dot products, then one rounding to float16: "
            "u = 2^-11 of the result, 2^-24 below its normal range)") in said
    assert "stored twice -> once, held twice -> twice" in said and "float32 widening of the float16 head" in said
    assert holding(onnx.load(out), table) == ["transformer.wte.weight"]  # once on disk
    # in a session: the float16 table and the CPU provider's float32 widening of it, read in place (not prepacked)
    data = findings(out)
    (entry,) = [v for v in data["vocabulary"] if v["table"] == "transformer.wte.weight"]
    assert (entry["tied"], entry["tables_in_memory"]) == (True, 2)
    copies = [(c["view"], c["bytes"]) for c in data["runtime_copies"] if c.get("copy_of") == entry["table"]]
    assert copies == [("widened", VOCAB * WIDTH * 4)]
    # the logits of both, on the same decoder feeds, within the bound computed here from the original's hidden
    original.graph.output.append(helper.make_empty_tensor_value_info(head.input[0]))
    feeds = feeds_for(original, {"input_ids": VOCAB}, np.random.default_rng(3))
    before, hidden = ort.InferenceSession(original.SerializeToString()).run(["logits", head.input[0]], feeds)
    (after,) = ort.InferenceSession(str(out)).run(["logits"], feeds)
    assert before.shape == after.shape == (1, 3, VOCAB) and before.dtype == after.dtype
    assert before.dtype == (np.float32 if keep_io_types else np.float16)
    bound = rounded_bound(hidden, table, before, "float16")
    apart = np.abs(before.astype(np.float64) - after.astype(np.float64))
    assert not np.isnan(after).any() and np.all((before == after) | (apart <= bound))


def test_retie_genai_float16_folder_is_proven_and_says_the_widening_stays(tmp_path):
    """genai's float16 table, stored once as the head's [width, vocab] weight: stored once as [vocab, width], the
    head a Gemm on its view; a session still holds the float16 table and the head's float32 widening (as before:
    the Transpose's float16 copy and the packed float32 one), and the outcome says why."""
    out = tmp_path / "out"
    done = run_inspect(os.path.join(FIXTURES, "genai_fp16"), "--retie", out)
    said = " ".join(unwrapped(done.stdout))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the logits within its float16 bound" in said and "every other output bit for bit" in said
    assert ("lm_head.MatMul.weight: stored once, held twice -> twice by the client's process under onnxruntime's "
            "defaults; one is onnxruntime's CPU provider's float32 widening of the float16 head's weight") in said
    model = onnx.load(out / "model.onnx")
    source = onnx.load(os.path.join(FIXTURES, "genai_fp16", "model.onnx"))
    table = numpy_helper.to_array(next(t for t in source.graph.initializer if t.name == "lm_head.MatMul.weight"))
    assert holding(model, table) == ["lm_head.MatMul.weight_rows"] and table.shape == (WIDTH, VOCAB)


def test_retie_a_transformersjs_float16_variant_writes_it_with_the_table_once(tmp_path):
    """transformers.js's model_fp16.onnx (the converter with keep_io_types=True, as its quantize script runs it)
    beside model.onnx: --files picks the variant; OUT is a transformers.js folder whose model_fp16.onnx, read with
    its own data file, holds the float16 table once."""
    from tests.fixtures.transformersjs_gpt2 import make
    folder = make(str(tmp_path / "tjs"))
    fp16 = convert_float_to_float16(onnx.load(os.path.join(folder, "onnx", "model.onnx")), keep_io_types=True)
    onnx.save(fp16, os.path.join(folder, "onnx", "model_fp16.onnx"))
    table = numpy_helper.to_array(next(t for t in fp16.graph.initializer if t.name == "transformer.wte.weight"))
    done = run_inspect(folder, "--files", "onnx/model_fp16.onnx", "--retie", tmp_path / "out")
    said = " ".join(unwrapped(done.stdout))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "onnx/model_fp16.onnx: transformer.wte.weight is now the one copy" in said
    assert "the logits within its float16 bound" in said and "stored twice -> once, held twice -> twice" in said
    assert sorted(os.listdir(tmp_path / "out" / "onnx")) == ["model_fp16.onnx", "model_fp16.onnx_data"]
    retied = onnx.load(tmp_path / "out" / "onnx" / "model_fp16.onnx")  # its data read from model_fp16.onnx_data
    assert holding(retied, table) == ["transformer.wte.weight"]


# --- the lab's float16 and bfloat16 tables, decoded to float32 for the head (a Cast) --------------------------------

@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_retie_a_duplicate_read_through_a_cast_multiplies_the_one_tables_cast(fmt, tmp_path):
    """graphs.untied_logits at float16 / bfloat16 with the head a copy of the table: each is Cast to float32 for the
    FusedMatMul, onnxruntime folds that Cast into a float32 table at load (and prepacks it). Retied, the head
    multiplies the Cast of the one table's view: both products are float32 sums of the same exactly widened values,
    within 2 gamma_w sum|h t| of each other."""
    values = graphs.make_table(300, 16, seed=2)
    source, out = tmp_path / "untied.onnx", tmp_path / "retied.onnx"
    onnx.save(graphs.untied_logits(values, values.copy(), fmt=fmt), source)
    original = onnx.load(source)
    stored = [t for t in original.graph.initializer if len(t.dims) == 2]
    assert [t.name for t in stored] == ["embedding", "lm_head"] and stored[0].raw_data == stored[1].raw_data
    done = run_inspect(source, "--retie", out)
    said = " ".join(unwrapped(done.stdout))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a Cast of it to float32" in said and "now runs at each call" in said
    assert "stored twice -> once, held twice -> once" in said
    retied = onnx.load(out)
    assert [t.name for t in retied.graph.initializer if len(t.dims) == 2] == ["embedding"]  # once on disk
    (entry,) = findings(out)["vocabulary"]
    assert (entry["format"], entry["tied"], entry["tables_in_memory"]) == (fmt, True, 1)
    table = numpy_helper.to_array(stored[0])  # the stored float16 / bfloat16 values; the Cast widens them exactly
    hidden = np.tanh(np.random.default_rng(5).standard_normal((2, 5, 16))).astype(np.float32)
    feeds = {"ids": np.random.default_rng(4).integers(0, 300, (2, 5)), "hidden": hidden}
    (before,), (after,) = (ort.InferenceSession(str(p)).run(["logits"], feeds) for p in (source, out))
    h, t = np.abs(hidden.astype(np.float64)).reshape(-1, 16), np.abs(table.astype(np.float64))
    bound = 2 * gamma(16) * (h @ t.T).reshape(before.shape)
    assert before.shape == after.shape == (2, 5, 300) and before.dtype == after.dtype == np.float32
    assert np.all(np.abs(before.astype(np.float64) - after) <= bound)


def test_a_bfloat16_head_onnxruntimes_cpu_provider_cannot_run_is_refused_in_one_line(tmp_path):
    """A bfloat16 table and its transposed copy as a bfloat16 MatMul head: onnxruntime's CPU provider has no
    bfloat16 MatMul (nor Gemm), so nothing can be measured or proven here: exit 2, its reason in one line."""
    import ml_dtypes  # onnx's own dependency: numpy's bfloat16
    values = graphs.make_table(300, 16, seed=3).astype(ml_dtypes.bfloat16)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["x"]), helper.make_node("MatMul", ["x", "head"], ["logits"])],
        "bfloat16_head", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.BFLOAT16, None)],
        [helper.make_tensor(name, TensorProto.BFLOAT16, v.shape, v.view(np.uint16).tobytes(), raw=True)
         for name, v in (("table", values), ("head", np.ascontiguousarray(values.T)))])
    source = tmp_path / "bfloat16.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), source)
    done = run_inspect(source, "--retie", tmp_path / "out.onnx")
    assert one_line_error(done.returncode, done.stderr, "NOT_IMPLEMENTED", "MatMul"), done.stderr
    assert not os.path.exists(tmp_path / "out.onnx")


# --- the bound itself -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_a_half_precision_head_just_past_its_bound_fails_and_just_within_passes(fmt):
    import ml_dtypes  # onnx's own dependency: numpy's bfloat16
    dtype = np.dtype(np.float16 if fmt == "float16" else ml_dtypes.bfloat16)
    rng = np.random.default_rng(6)
    table, hidden = rng.standard_normal((40, 32)).astype(dtype), rng.standard_normal((3, 32)).astype(dtype)
    rounded = (hidden.astype(np.float64) @ table.astype(np.float64).T).astype(np.float32).astype(dtype)
    bound = rounded_bound(hidden, table, rounded, fmt)
    at = np.unravel_index(np.argmax(rounded.astype(np.float64)), rounded.shape)  # positive: one more bit, one up
    head_of, chains, tables = {"logits": ("hidden", "table")}, {"logits": [("logits", 1.0, 0)]}, {"table": table}
    moved, last = rounded.copy(), None
    while True:  # step one value of the format up at a time: the last within the bound passes, the next fails
        moved.view(np.uint16)[at] += 1
        within = float(moved[at]) - float(rounded[at]) <= bound[at]
        failures = agree.compare({"logits": rounded, "hidden": hidden}, {"logits": moved, "hidden": hidden},
                                 head_of, chains, tables)
        assert bool(failures) != within, (float(moved[at]), bound[at], failures)
        if not within:
            break
        last = float(moved[at])
    assert last is not None  # a value one step away is within: the bound is no stricter than the format
    assert f"differs beyond its {fmt} bound" in failures[0]


# --- q4f16: transformers.js's recipe quantizes the head too -------------------------------------------------------

def test_q4f16_holds_a_float16_table_and_4_bit_head_codes_a_quantized_copy_left_and_said(tmp_path):
    """make_q4f16_fixture.py (MatMulNBits quantizer, then the float16 converter): the head is MatMulNBits on 4-bit
    codes of the table with float16 scales, each value within a scale step of the float16 table's; neither
    can read the other's without changing the logits, so --retie leaves them and says in one line that
    --lookup-from-head (opt-in) would make the lookup read the head's codes."""
    path = os.path.join(FIXTURES, "ortquant_q4f16", "model.onnx")
    model = onnx.load(path)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (head,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    table, codes, scales = weights["transformer.wte.weight"], weights[head.input[1]], weights[head.input[2]]
    assert (table.dtype, codes.dtype, scales.dtype, codes.shape) == (np.float16, np.uint8, np.float16, (VOCAB, 2, 16))
    q = np.stack([codes & 15, codes >> 4], axis=-1).reshape(VOCAB, 2, 32).astype(np.float64)  # low nibble first
    decoded = ((q - 8) * scales.astype(np.float64)[..., None]).reshape(VOCAB, WIDTH)  # symmetric: zero point 8
    step = np.abs(np.repeat(scales.astype(np.float64), 32, axis=1))
    # quantized in float32 (half a step; a whole one where a code is clipped to 7), then table and scales rounded
    # to float16 (u = 2^-11 of each; a code is at most 8)
    apart = np.abs(decoded - table)
    assert np.all(apart <= step * (1 + 8 * 2**-11) + 2**-11 * np.abs(table.astype(np.float64)))
    assert np.any(apart > 2**-11 * np.abs(table.astype(np.float64)) + 2**-25)  # not the table's values: a copy
    (pair,) = [p for p in findings(path)["pairs"] if p["relation"] != "distinct"]
    assert (pair["table"], pair["head"], pair["relation"]) == ("transformer.wte.weight", head.input[1],
                                                               "quantized_copy")
    done = run_inspect(path, "--retie", tmp_path / "out.onnx")
    lines = unwrapped(done.stdout)
    assert done.returncode == 0 and not os.listdir(tmp_path)
    assert f"retie: transformer.wte.weight / {head.input[1]} (quantized_copy): a quantized copy: --lookup-from-head " \
           "makes the lookup read the head's codes, --shared-int8 both read one int8 table (opt-in: the values then " \
           "change by up to a quantization step)" in lines


def test_a_float16_model_the_cpu_provider_fails_inside_its_own_cast_is_refused_for_that_reason():
    # onnxruntime 1.32's words on onnxruntime-genai's SmolLM2 float16 export (genai's Generator fails the same way),
    # at its first decoding step on the CPU provider
    error = RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Cast node. "
                         "Name:'InsertedPrecisionFreeCast_/model/layers.1/attn/v_proj/repeat_kv/Reshape_4/output_0' "
                         "Status Message: /onnxruntime_src/onnxruntime/core/framework/op_kernel.cc:87 virtual "
                         "OrtValue* onnxruntime::OpKernelContext::OutputMLValue(int, const onnxruntime::TensorShape&)"
                         " [ONNXRuntimeError] : 1 : FAIL : Shape mismatch attempting to re-use buffer. {1,1,576} != "
                         "{1,5,576}. Validate usage of dim_value (values should be > 0)")
    line = proof.refused("1 new token after past 4", error)
    assert line.startswith("onnxruntime's CPU provider cannot run this float16 model on the proof's feeds (1 new "
                           "token after past 4): a Cast it inserted")
    assert "{1,1,576} != {1,5,576}" in line and "onnxruntime-genai issue 2009" in line and "--proof-past" not in line
    other = proof.refused("1 new token after past 4", RuntimeError("Invalid rank for input: past_key_values.0.key"))
    assert other.endswith("Invalid rank for input: past_key_values.0.key (--proof-past N sets the past length)")


# --- a float16 model's other weights, widened by the CPU provider (issue 57) ----------------------------------------

def float16_others(path, table):
    """The float16 matrices of the model at `path` other than `table`: the weights the CPU provider widens."""
    return [t for t in onnx.load(path).graph.initializer
            if t.data_type == TensorProto.FLOAT16 and len(t.dims) == 2 and t.name != table]


def test_a_float16_models_widened_weights_are_one_line_and_listed_under_verbose():
    """A 30-layer float16 export printed one "runtime copy FusedBack_..." line for each of 212 weights (443 lines);
    they hold no table's values: one line with their count and bytes, --verbose lists them."""
    from runtime.model.findings.counting import human
    path = model_in("genai_fp16")
    others = float16_others(path, "lm_head.MatMul.weight")
    widened = sum(4 * int(np.prod(t.dims)) for t in others)  # each held as float32
    said = unwrapped(run_inspect(path).stdout)
    (line,) = [line for line in said if line.startswith("runtime copies of ") and "other weights" in line]
    assert line == (f"runtime copies of {len(others)} other weights, {human(widened)}: their float32 widenings "
                    "(--verbose lists them)")
    (line,) = [line for line in said if line.startswith("runtime copies of lm_head.MatMul.weight: ")]
    assert line.startswith("runtime copies of lm_head.MatMul.weight: FusedBack_lm_head.MatMul.weight widened, "
                           "128.0 KiB")  # the table's own widening stays named
    verbose = run_inspect(path, "--verbose").stdout  # the layers' weights and the sin / cos caches
    assert verbose.count("runtime copy FusedBack_") == len(others)


def test_the_memory_ratio_counts_the_other_weights_as_widened():
    """Every float16 form's memory line said 7.11x the table beyond the other weights: the others' float32
    widenings were counted as copies of the table. widened_others gives what they add beyond their stored bytes."""
    from runtime.model.findings.copies import widened_others
    from runtime.model.read.model import load
    path = model_in("genai_fp16")
    data = findings(path)
    others = float16_others(path, "lm_head.MatMul.weight")
    added = widened_others(load(path), data["runtime_copies"], {"lm_head.MatMul.weight"})
    assert added == sum(2 * int(np.prod(t.dims)) for t in others)  # float32's 4 bytes where float16 stored 2


def test_a_folders_memory_ratio_counts_the_other_weights_as_widened_too(tmp_path):
    """The folder form of the same model said 7.11x where its file said 3.36x (SmolLM2's genai fp16): across the
    files, the other weights are counted as the sessions hold them, widened, as in a file's report: the bytes
    examine_folder.widened adds to them are float32's 4 where float16 stored 2, for each weight but the table."""
    from runtime.inspect.examine_folder import inspect_folder, widened
    from runtime.inspect.sandbox import isolated
    path = model_in("genai_fp16")
    result = inspect_folder(os.path.dirname(path), str(tmp_path), isolated.Limits(300))
    (group,) = [v for v in result["across"]["vocabulary"] if v["kind"] == "token"]
    assert widened(group, result["items"]) == sum(2 * int(np.prod(t.dims))
                                                  for t in float16_others(path, "lm_head.MatMul.weight")) > 0


@pytest.mark.parametrize("fixture, sizes", [("genai_fp16", [VOCAB * WIDTH]), ("genai_fp32", [VOCAB * WIDTH]),
                                            ("optimum_gpt2", [VOCAB * WIDTH]),
                                            ("genai_int4", [VOCAB * WIDTH // 2])])  # two 4-bit codes a byte
def test_a_layout_written_with_prepacking_off_probes_what_kernels_pack_of_the_tables(fixture, sizes, tmp_path):
    """Issue 57's decision: a layout written apart is written with prepacking off (the kernels' packings of every
    weight, and of float16 weights' float32 widenings, were held beside them); the packing of each table and copy
    of one (a float16 head's widening, a transposed copy, MatMulNBits' codes) is probed apart, and equals what
    onnxruntime records writing the layout with prepacking on."""
    from runtime.inspect.sandbox import probed
    from runtime.resident import prepacked_copies
    from runtime.optimized import write_optimized_layout
    path = model_in(fixture)  # each fixture's table: 512 x 64
    layouts = {}
    for prepacking in (True, False):
        out = tmp_path / f"layout-{prepacking}.onnx"
        write_optimized_layout(path, out, prepacking=prepacking)
        layouts[prepacking] = onnx.load(out, load_external_data=False)
    watched = {t.name for t in layouts[True].graph.initializer if np.prod(t.dims) in sizes}
    recorded = [p for p in prepacked_copies(layouts[True]) if p["initializer"] in watched]
    assert recorded and all(p["bytes"] > 0 for p in recorded)
    assert prepacked_copies(layouts[False]) == []  # nothing recorded: what the probe stands in for
    key = lambda p: (p["initializer"], p["node"])
    assert sorted(probed.unrecorded(layouts[False], sizes).probed, key=key) == sorted(recorded, key=key)


def test_a_float16_layout_written_apart_reports_what_prepacking_on_reports(tmp_path):
    """inspect on a float16 model whose layout is written apart, with prepacking off: the same runtime copies and
    copies held as where the measured session writes it with prepacking on, and prepacked_unrecorded says so."""
    from runtime.inspect.sandbox import probed
    from runtime.resident import prepacked_copies
    from runtime.optimized import write_optimized_layout
    path, table = model_in("genai_fp16"), "lm_head.MatMul.weight"
    write_optimized_layout(path, tmp_path / "layout.onnx")
    recorded = [p for p in prepacked_copies(onnx.load(tmp_path / "layout.onnx", load_external_data=False))
                if p["initializer"] == f"FusedBack_{table}"]
    assert len(recorded) == 1 and recorded[0]["kernel"] == "MatMul" and recorded[0]["bytes"] >= 4 * VOCAB * WIDTH

    # the layout is written apart where the float16 weights pass OWNED_MOST (here: 2 MiB of them no node reads,
    # which onnxruntime drops)
    model = onnx.load(path)
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(2**20, np.float16), "unread"))
    onnx.save(model, tmp_path / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    shutil.copy(os.path.join(os.path.dirname(path), "genai_config.json"), tmp_path)  # the past's shape: measured
    found = {}
    for name, at in (("as made", path), ("past OWNED_MOST", tmp_path / "model.onnx")):
        done = run_inspect(at, "--json")
        assert done.returncode in (0, 1), done.stderr
        found[name] = json.loads(done.stdout)
    assert found["as made"]["prepacked_unrecorded"] is None
    assert found["past OWNED_MOST"]["prepacked_unrecorded"] == {"why": probed.WHY, "probed": recorded}
    copies = lambda data: [{k: c[k] for k in ("name", "copy_of", "view", "bytes")} for c in data["runtime_copies"]
                           if c.get("copy_of")]
    held = lambda data: [v["in_memory"]["defaults"]["copies"] for v in data["vocabulary"]]
    assert copies(found["past OWNED_MOST"]) == copies(found["as made"]) and len(copies(found["as made"])) >= 2
    assert held(found["past OWNED_MOST"]) == held(found["as made"]) == [2]


def test_a_probe_onnxruntime_refuses_writes_the_layout_again_with_its_packings_recorded(tmp_path, monkeypatch):
    """Where a node alone cannot be probed (onnxruntime refusing it, whatever the reason), the layout written with
    prepacking off is written again with it on, its packings recorded as onnxruntime makes them: nothing is lost,
    the session only costs what it did before the decision."""
    from runtime.inspect.sandbox import probed, work
    from runtime.resident import prepacked_copies
    model = onnx.load(model_in("genai_fp16"))
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(2**20, np.float16), "unread"))  # past OWNED_MOST
    path, layout = str(tmp_path / "model.onnx"), str(tmp_path / "layout.onnx")
    onnx.save(model, path, save_as_external_data=True, location="model.onnx.data")
    shell = onnx.load(path, load_external_data=False)
    assert probed.packing_off(shell)
    data, saved, unrecorded = work._written_apart((path, str(tmp_path)), layout, shell, [VOCAB * WIDTH])
    assert (data, saved) == (False, None) and unrecorded.probed  # probed
    assert prepacked_copies(onnx.load(layout, load_external_data=False)) == []

    def refused(*args):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : a node alone refused")
    monkeypatch.setattr(probed, "_probed", refused)
    data, saved, unrecorded = work._written_apart((path, str(tmp_path)), layout, shell, [VOCAB * WIDTH])
    assert (data, saved, unrecorded) == (False, None, None)
    recorded = prepacked_copies(onnx.load(layout, load_external_data=False))
    assert [p["initializer"] for p in recorded if p["initializer"] == "FusedBack_lm_head.MatMul.weight"]
