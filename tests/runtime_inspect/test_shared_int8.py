"""--retie OUT --shared-int8: one int8 table, made anew from the float lookup table, read by the MatMulNBits head
(bits=8) and by the lookup. The expected codes, scales and rows are computed here from the fixture's float table with
numpy, by the rule docs/retie.md states, apart from the code under test."""
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from runtime.inspect.retie import int8share
from tests.helpers import FIXTURES, inspected, refused, run_inspect, unwrapped
from tests.runtime_inspect.test_lookup_from_head import CASES, all_ids_feeds, run, with_output


def symmetric_int8(table, scale_type, block=32):
    """The rule, written out: per block of `block` values along the width, scale = max|x| / 127 rounded to
    `scale_type`, code = round-half-even(x / scale) clipped to +-127, stored plus 128; a zero block: scale 0, 128."""
    vocab, width = table.shape
    codes = np.full((vocab, width // block, block), 128, np.uint8)
    scales = np.zeros((vocab, width // block), scale_type)
    for t in range(vocab):
        for b in range(width // block):
            x = table[t, b * block:(b + 1) * block].astype(np.float64)
            s = scale_type(np.abs(x).max() / 127)
            scales[t, b] = s
            if s > 0:
                codes[t, b] = np.clip(np.round(x / np.float64(s)), -127, 127).astype(np.int64) + 128
    return codes, scales


def test_requantized_follows_the_rule_and_holds_a_q8_0_table_exactly():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((40, 96)).astype(np.float32)
    table[3] = 0.0  # a padding row
    codes, scales = int8share.requantized(table, np.float32)
    want_codes, want_scales = symmetric_int8(table, np.float32)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
    # a table of Q8_0 values (d x q, q within +-127, the largest |q| 127 in each block) comes back exactly
    q = rng.integers(-127, 128, size=(40, 3, 32))
    q[:, :, 0] = 127
    d = rng.random((40, 3, 1)).astype(np.float32)
    exact = (q * d.astype(np.float64)).astype(np.float32).reshape(40, 96)
    codes, scales = int8share.requantized(exact, np.float32)
    back = ((codes.astype(np.float64) - 128) * scales[..., None]).astype(np.float32).reshape(40, 96)
    assert np.array_equal(back, exact)


@pytest.mark.parametrize("fixture", sorted(CASES))
def test_one_int8_table_read_by_the_head_and_the_lookup(fixture, tmp_path):
    table, name = CASES[fixture]
    source = os.path.join(FIXTURES, fixture)
    done = inspected(source, "--retie", tmp_path / "out", "--shared-int8")
    original = onnx.load(os.path.join(source, name))
    retied = onnx.load(str(tmp_path / "out" / name))
    float_table = numpy_helper.to_array(next(t for t in original.graph.initializer if t.name == table))
    vocab = 512
    values = float_table if float_table.shape[0] == vocab else float_table.T
    weights = {t.name: t for t in retied.graph.initializer}
    assert table not in weights  # the float table is gone
    (head,) = [n for n in retied.graph.node if n.op_type == "MatMulNBits" and
               any(a.name == "N" and a.i == vocab for a in n.attribute)]
    attrs = {a.name: a.i for a in head.attribute}
    assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (8, 32, 4)
    assert len(head.input) == 3  # no zero points
    (lookup,) = [n for n in retied.graph.node if n.input[:1] == [head.input[1]] and n is not head] or [None]
    assert lookup is not None and lookup.op_type == "GatherBlockQuantized"  # the same codes, read in place
    codes = numpy_helper.to_array(weights[head.input[1]])
    scales = numpy_helper.to_array(weights[head.input[2]])
    want_codes, want_scales = symmetric_int8(values, scales.dtype.type)
    assert np.array_equal(codes, want_codes)
    assert np.array_equal(scales.reshape(want_scales.shape).view(np.uint8), want_scales.view(np.uint8))
    # every id's looked-up row: (code - 128) x scale, rounded once to the scales' type, bit for bit
    expected = ((want_codes.astype(np.float64) - 128) * want_scales.astype(np.float64)[..., None]).reshape(
        vocab, -1).astype(scales.dtype)
    rows_name = lookup.output[0]
    rows_name = next((n.output[0] for n in retied.graph.node if n.input[:1] == [rows_name] and
                      n.op_type == "Reshape"), rows_name)
    session = ort.InferenceSession(str(tmp_path / "out" / name))
    got = run(with_output(retied, rows_name), str(tmp_path / "out"), all_ids_feeds(session, vocab))
    looked_up = got[rows_name].reshape(expected.shape)
    assert np.array_equal(looked_up.view(np.uint8), expected.view(np.uint8))
    said = unwrapped(done.stdout)
    assert any("int8 codes made anew from" in line and "blocks of 32" in line for line in said)
    assert any("against the original with its head's int8 codes and their rows" in line for line in said)
    size = sum(os.path.getsize(tmp_path / "out" / f) for f in os.listdir(tmp_path / "out") if "onnx" in f)
    was = sum(os.path.getsize(os.path.join(source, f)) for f in os.listdir(source) if "onnx" in f)
    assert size < was - float_table.nbytes + codes.nbytes + scales.nbytes  # the old head's codes went too


def test_the_two_ways_exclude_each_other(tmp_path):
    done = run_inspect(os.path.join(FIXTURES, "ortquant_q4", "model.onnx"), "--retie", tmp_path / "out.onnx",
                       "--lookup-from-head", "--shared-int8", timeout=60)
    assert refused(done, "--lookup-from-head", "--shared-int8") and not os.listdir(tmp_path)
    done = run_inspect(os.path.join(FIXTURES, "ortquant_q4", "model.onnx"), "--shared-int8", timeout=60)
    assert refused(done, "--shared-int8", "--retie")


@pytest.mark.slow
def test_genai_generator_runs_the_shared_int8(tmp_path):
    """onnxruntime-genai's Generator loads OUT and generates the tokens onnxruntime's own greedy run of OUT picks."""
    from tests.helpers import PROMPTS, genai_tokens
    from tests.runtime_inspect.test_lookup_from_head import plain_greedy
    inspected(os.path.join(FIXTURES, "genai_int4_unshared"), "--retie", tmp_path / "out", "--shared-int8")
    assert genai_tokens(tmp_path / "out", new=6) == [plain_greedy(tmp_path / "out" / "model.onnx", p, 6)
                                                     for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q4", "q4f16"])
def test_transformersjs_node_and_browser_run_the_shared_int8(tmp_path, dtype):
    """transformers.js in Node (onnxruntime-node) and in headless Chromium (onnxruntime-web's WASM) loads OUT's
    variant, its head an 8-bit MatMulNBits and its lookup decoded in standard ops, and greedy-decodes the tokens
    onnxruntime's own run of that file picks."""
    from tests import transformersjs_client as client
    from tests.fixtures import transformersjs_gpt2
    from tests.runtime_inspect.test_transformersjs import NEW, PROMPTS as TJS_PROMPTS, ort_greedy
    if not client.node():
        pytest.skip("no node on this machine")
    original = transformersjs_gpt2.make(str(tmp_path / "gpt2"), dtypes=(dtype,))
    out = str(tmp_path / "out")
    inspected(original, "--dtype", dtype, "--retie", out, "--shared-int8")
    name = {"q4": "model_q4.onnx", "q4f16": "model_q4f16.onnx"}[dtype]
    model = onnx.load(os.path.join(out, "onnx", name))
    assert any(n.op_type == "MatMulNBits" and {a.name: a.i for a in n.attribute}["bits"] == 8 for n in model.graph.node)
    expected = [ort_greedy(os.path.join(out, "onnx", name), p, NEW) for p in TJS_PROMPTS]
    assert client.node_greedy(out, TJS_PROMPTS, NEW, dtype=dtype)["tokens"] == expected
    if client.chromium():
        assert client.browser_greedy(out, TJS_PROMPTS, NEW, dtype=dtype)["tokens"] == expected


def test_a_width_of_part_blocks_is_left_and_said(tmp_path):
    """A table 48 wide: --lookup-from-head could read a head's 16-value blocks of it, but 48 is not whole blocks of
    32, so --shared-int8 leaves the pair and says why (requantized's reshape raised before)."""
    import dataclasses
    from runtime.inspect.retie import rules
    from runtime.inspect.retie.rules import Lossy, SHARED_INT8
    from runtime.model.found import static_findings
    from runtime.model.read.model import load
    model = load(os.path.join(FIXTURES, "ortquant_q4_asym", "model.onnx"))
    (pair,) = [p for p in static_findings(model).pairs if p.relation == "quantized_copy"]
    narrow = dataclasses.replace(pair, table_entry=dataclasses.replace(pair.table_entry, width=48))
    assert rules.remedy(narrow, Lossy(SHARED_INT8)) == (
        None, "a width of 48 is not whole blocks of 32: --shared-int8 leaves it as it is")
    assert rules.remedy(pair, Lossy(SHARED_INT8)) == (SHARED_INT8, None)
