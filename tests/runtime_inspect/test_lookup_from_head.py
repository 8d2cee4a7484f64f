"""--retie OUT --lookup-from-head on real quantizers' outputs: a float lookup table beside MatMulNBits head codes of
the same values (make_lookup_from_head_fixtures.py, make_more_genai_fixtures.py, make_q4f16_fixture.py). Every
expected number here is decoded from the fixture's own initializers with numpy, apart from the code under test."""
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from tests.helpers import FIXTURES, PROMPTS, genai_tokens, inspected, one_line_error, run_inspect, unwrapped

CASES = {  # fixture: (the float table, the file a client loads)
    "ortquant_q4": ("transformer.wte.weight", "model.onnx"),  # transformers.js's q4 recipe
    "ortquant_q4_asym": ("transformer.wte.weight", "model.onnx"),  # zero points, block 16
    "ortquant_q8": ("transformer.wte.weight", "model.onnx"),  # 8 bits
    "ortquant_q4f16": ("transformer.wte.weight", "model.onnx"),  # float16 table and scales
    "ortquant_nbits": ("lm_head.MatMul.weight", "model.onnx"),  # stored [width, vocab], read through a Transpose
    "genai_int4_unshared": ("model.embed_tokens.weight", "model.onnx"),  # onnxruntime-genai, shared_embeddings=false
}


def head_rows(model, vocab=512):
    """The MatMulNBits head's (the one of `vocab` rows) dequantization [N, K] in its scales' type, decoded here: low nibble first, zero points
    two a byte (default 2^(bits-1)), (code - zero point) x scale exact in float64, then rounded once."""
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits" and
               any(a.name == "N" and a.i == vocab for a in n.attribute)]
    attrs = {a.name: a.i for a in node.attribute}
    codes, scales = weights[node.input[1]], weights[node.input[2]]
    n, blocks = codes.shape[:2]
    if attrs["bits"] == 4:
        codes = np.stack([codes & 15, codes >> 4], axis=-1)
    codes = codes.reshape(n, blocks, attrs["block_size"]).astype(np.float64)
    if len(node.input) > 3 and node.input[3]:
        packed = weights[node.input[3]].reshape(n, -1)
        points = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, -1) if attrs["bits"] == 4 else packed
        points = points[:, :blocks].astype(np.float64)
    else:
        points = np.full((n, blocks), 2.0 ** (attrs["bits"] - 1))
    exact = (codes - points[..., None]) * scales.reshape(n, blocks, 1).astype(np.float64)
    return exact.reshape(n, -1).astype(scales.dtype), node.input[1]


HEAD_SIZE = 16  # the fixtures' width 64 over 4 attention heads


def past_dim(dim, batch):
    """A past input's dim for an empty past: the batch, 0 past tokens, the head size where the dim is named."""
    if not isinstance(dim, str):
        return dim
    return batch if "batch" in dim else 0 if "sequence" in dim else HEAD_SIZE


def all_ids_feeds(session, vocab, positions=128):
    """Feeds that look up every id once: [vocab / positions, positions] ids, an empty past."""
    rows = vocab // positions
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.arange(vocab, dtype=np.int64).reshape(rows, positions)
        elif "past" in i.name:
            dims = [past_dim(d, rows) for d in i.shape]
            feeds[i.name] = np.zeros(dims, np.float16 if "float16" in i.type else np.float32)
        elif i.name == "position_ids":
            feeds[i.name] = np.tile(np.arange(positions, dtype=np.int64), (rows, 1))
        else:
            feeds[i.name] = np.ones((rows, positions), np.int64)
    return feeds


def with_output(model, name):
    """`model` with the value `name` as one more graph output."""
    shown = onnx.ModelProto()
    shown.CopyFrom(model)
    shown.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return shown


def run(model, folder, feeds):
    """Every output of `model` (a ModelProto whose external data lies in `folder`) under onnxruntime's defaults."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
    session = ort.InferenceSession(model.SerializeToString(), options)
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


@pytest.mark.parametrize("fixture", sorted(CASES))
def test_lookup_from_head_rows_are_the_heads_and_all_else_bit_for_bit(fixture, tmp_path):
    table, name = CASES[fixture]
    source = os.path.join(FIXTURES, fixture)
    done = inspected(source, "--retie", tmp_path / "out", "--lookup-from-head")
    original = onnx.load(os.path.join(source, name))
    retied = onnx.load(str(tmp_path / "out" / name))
    expected, codes = head_rows(original)
    weights = {t.name: t for t in original.graph.initializer}
    float_table = numpy_helper.to_array(weights[table])
    assert table not in {t.name for t in retied.graph.initializer}  # the float table is gone
    (lookup,) = [n for n in retied.graph.node if n.op_type == "GatherBlockQuantized"]
    assert lookup.input[0] == codes and lookup.domain == "com.microsoft"  # it reads the head's codes in place
    views = {table} | {m.output[0] for m in original.graph.node if m.input[:1] == [table]}  # it, or its Transpose
    rows_name = next(n.output[0] for n in original.graph.node if n.op_type == "Gather" and n.input[0] in views)
    # every id's row, as OUT's own graph looks it up: the head's dequantization, bit for bit
    session = ort.InferenceSession(str(tmp_path / "out" / name))
    feeds = all_ids_feeds(session, expected.shape[0])
    got = run(with_output(retied, rows_name), str(tmp_path / "out"), feeds)
    looked_up = got[rows_name].reshape(expected.shape)
    assert looked_up.dtype == expected.dtype and np.array_equal(looked_up.view(np.uint8), expected.view(np.uint8))
    # the original, its float table replaced by those rows (in its own layout): every output bit for bit
    swapped = onnx.ModelProto()
    swapped.CopyFrom(original)
    stored = expected if float_table.shape == expected.shape else expected.T
    weights = {t.name: t for t in swapped.graph.initializer}
    weights[table].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(stored), table))
    before = run(swapped, source, feeds)
    for output, value in before.items():
        assert np.array_equal(value.view(np.uint8), got[output].view(np.uint8)), output
    # the original's own rows moved by at most a quantization step (a clipped code: one; else half)
    said = unwrapped(done.stdout)
    change = np.abs(expected.astype(np.float64) - (float_table if float_table.shape == expected.shape
                                                   else float_table.T).astype(np.float64))
    moved = next(line for line in said if "is gone: the lookup reads" in line)
    assert f"moved by up to {change.max():.3g} " in moved and "every id checked" in moved
    price = next(line for line in said if "its price on the model's choices was not measured" in line)
    assert "no tokenizer.json" in price  # none here: the greedy runs' agreement is --json's
    agreement = json.loads(inspected(source, "--retie", tmp_path / "again", "--lookup-from-head", "--json").stdout)
    (entry,) = agreement["retie"]["lookup_from_head"]
    assert entry["token_agreement"]["prompts_from"] == "fixed ids" and entry["token_agreement"]["tokens"] == 128
    size = sum(os.path.getsize(tmp_path / "out" / f) for f in os.listdir(tmp_path / "out") if "onnx" in f)
    was = sum(os.path.getsize(os.path.join(source, f)) for f in os.listdir(source) if "onnx" in f)
    assert size <= was - 0.85 * float_table.nbytes  # the target: the float table's bytes, less what the view adds


def test_lookup_from_head_is_said_in_the_verdict_and_does_not_fail_check():
    source = os.path.join(FIXTURES, "ortquant_q4", "model.onnx")
    data = json.loads(inspected(source, "--json").stdout)
    (entry,) = [e for e in data["verdict"] if e["kind"] == "quantized_copy"]
    table = next(t for t in onnx.load(source).graph.initializer if t.name == "transformer.wte.weight")
    assert entry["fix"] == "--retie OUT --lookup-from-head" and entry["why_not"] is None
    assert entry["wasted_bytes_on_disk"] == numpy_helper.to_array(table).nbytes == entry["wasted_bytes_in_memory"]
    assert run_inspect(source, "--check").returncode == 0  # informational
    said = unwrapped(inspected(source).stdout)
    assert any(line.startswith("  fix: --retie OUT --lookup-from-head (opt-in: saves 128.0 KiB on disk") for line in said)


def test_without_the_flag_the_pair_is_left_and_the_flag_named(tmp_path):
    done = inspected(os.path.join(FIXTURES, "ortquant_q4"), "--retie", tmp_path / "out")
    assert "--lookup-from-head makes the lookup read the head's codes" in " ".join(unwrapped(done.stdout))
    assert "nothing to do" in done.stdout and not os.path.exists(tmp_path / "out")


def test_lookup_from_head_needs_retie():
    done = run_inspect(os.path.join(FIXTURES, "ortquant_q4"), "--lookup-from-head")
    assert one_line_error(done.returncode, done.stderr, "--lookup-from-head", "--retie")


def test_a_zero_point_ignored_fails_the_proof_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from runtime.inspect import cli
    from runtime.inspect.retie import headlookup
    monkeypatch.setattr(headlookup, "unpacked_zero_points", lambda model, q, vocab, blocks: np.full(
        (vocab, blocks), 8, np.uint8))  # MatMulNBits' default, not the stored ones
    status = cli.main([os.path.join(FIXTURES, "ortquant_q4_asym"), "--retie", str(tmp_path / "out"),
                       "--lookup-from-head"], supervised=False)
    out = capsys.readouterr().out
    assert status == 1 and "not proven, nothing written" in out and not os.path.exists(tmp_path / "out")


def test_a_row_off_by_one_code_is_named_by_its_id(tmp_path):
    """headrows' check of every id against the head's rows: one element of row 300 one quantization step off is
    found there, and nowhere else."""
    from runtime.inspect.sandbox import headrows
    out = tmp_path / "out"
    inspected(os.path.join(FIXTURES, "ortquant_q4"), "--retie", out, "--lookup-from-head")
    original = onnx.load(os.path.join(FIXTURES, "ortquant_q4", "model.onnx"))
    rows, codes = head_rows(original)
    scales = numpy_helper.to_array(next(t for t in original.graph.initializer if t.name.endswith("_scales")))
    lookup = {"output": "/transformer/wte/Gather_output_0", "table": "transformer.wte.weight",
              "rows": str(tmp_path / "rows.npy")}
    np.save(lookup["rows"], rows)
    retied = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert headrows.rows_equal(retied, str(out / "model.onnx"), lookup).rows_equal_head
    rows[300, 5] += scales[300, 0]  # one code up
    np.save(lookup["rows"], rows)
    assert headrows.rows_equal(retied, str(out / "model.onnx"), lookup) == (
        "transformer.wte.weight", False, 300)  # table, rows_equal_head, first_different


def plain_greedy(path, prompt, new):
    """`new` greedy tokens of the decoder at `path` after `prompt`, each step the whole sequence again from an empty
    past, under onnxruntime's defaults (no client)."""
    session, tokens = ort.InferenceSession(str(path)), list(prompt)
    for _ in range(new):
        feeds = {}
        for i in session.get_inputs():
            if i.name == "input_ids":
                feeds[i.name] = np.array([tokens], np.int64)
            elif "past" in i.name:
                feeds[i.name] = np.zeros([past_dim(d, 1) for d in i.shape], np.float32)
            else:
                feeds[i.name] = np.ones((1, len(tokens)), np.int64)
        logits = session.run(["logits"], feeds)[0]
        tokens.append(int(np.argmax(logits[0, -1])))
    return tokens[len(prompt):]


@pytest.mark.slow
def test_genai_generator_runs_the_lookup_from_head(tmp_path):
    """onnxruntime-genai's Generator loads OUT and generates, picking the tokens onnxruntime's own greedy run of OUT
    picks (its rows looked up from the head's codes); the original's run differently where the rows changed."""
    source = os.path.join(FIXTURES, "genai_int4_unshared")
    inspected(source, "--retie", tmp_path / "out", "--lookup-from-head")
    generated = genai_tokens(tmp_path / "out", new=6)
    assert generated == [plain_greedy(tmp_path / "out" / "model.onnx", p, 6) for p in PROMPTS]
    assert genai_tokens(source, new=6) == [plain_greedy(os.path.join(source, "model.onnx"), p, 6) for p in PROMPTS]


def test_json_holds_the_retie_record(tmp_path):
    """With --json the document follows the retie and holds its record: each lookup's row check and change (the
    change recomputed here from the fixture's own table and codes), and the greedy agreement."""
    source = os.path.join(FIXTURES, "ortquant_q4f16")
    done = inspected(source, "--retie", tmp_path / "out", "--lookup-from-head", "--json")
    retied = json.loads(done.stdout)["retie"]
    original = onnx.load(os.path.join(source, "model.onnx"))
    expected, codes = head_rows(original)
    table = numpy_helper.to_array(next(t for t in original.graph.initializer if t.name == "transformer.wte.weight"))
    (record,) = retied["lookup_from_head"]
    assert (retied["status"], record["table"], record["head"], record["rows_equal_head"]) == (
        0, "transformer.wte.weight", codes, True)
    assert record["max_row_change"] == np.abs(expected.astype(np.float64) - table.astype(np.float64)).max()
    agreement = record["token_agreement"]
    assert (agreement["prompts"], agreement["tokens"]) == (8, 128) and 0 <= agreement["agreed"] <= 128
    assert record["max_logit_change"] >= 0 and (agreement["agreed"] == 128) <= (agreement["same_first"] == 8)


@pytest.fixture(scope="module")
def tjs_folders(tmp_path_factory):
    """A transformers.js folder with q4 and q4f16 variants (transformers.js's recipes, tests/fixtures/
    transformersjs_gpt2.py) and its --retie OUT --lookup-from-head."""
    from tests.fixtures import transformersjs_gpt2
    where = tmp_path_factory.mktemp("tjs")
    original = transformersjs_gpt2.make(str(where / "gpt2"), dtypes=("q4", "q4f16"))
    inspected(original, "--retie", where / "out", "--lookup-from-head")
    return original, str(where / "out")


def test_each_transformersjs_variant_looks_up_from_the_head(tjs_folders):
    original, out = tjs_folders
    for name in ("model_q4.onnx", "model_q4f16.onnx"):  # decoded in standard ops: the browser has no kernel for
        model = onnx.load(os.path.join(out, "onnx", name))  # GatherBlockQuantized (onnxruntime-web 1.31's WASM)
        codes = head_rows(model)[1]
        assert "transformer.wte.weight" not in {t.name for t in model.graph.initializer}, name
        assert not any(n.op_type == "GatherBlockQuantized" for n in model.graph.node), name
        assert any(n.op_type == "Gather" and n.input[0] == codes for n in model.graph.node), name
    fp32 = onnx.load(os.path.join(out, "onnx", "model.onnx"))  # no head codes: the float variant as it was
    assert "transformer.wte.weight" in {t.name for t in fp32.graph.initializer}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q4", "q4f16"])
def test_transformersjs_node_and_browser_run_the_lookup_from_head(tjs_folders, dtype):
    """transformers.js itself, in Node (onnxruntime-node) and in headless Chromium (onnxruntime-web's WASM), loads
    OUT's variant and greedy-decodes the tokens onnxruntime's own run of that file picks. (With GatherBlockQuantized
    the browser refused it: "Failed to find kernel for com.microsoft.GatherBlockQuantized(1)".)"""
    from tests import transformersjs_client as client
    from tests.runtime_inspect.test_transformersjs import NEW, PROMPTS as TJS_PROMPTS, ort_greedy
    if not client.node():
        pytest.skip("no node on this machine")
    original, out = tjs_folders
    name = {"q4": "model_q4.onnx", "q4f16": "model_q4f16.onnx"}[dtype]
    expected = [ort_greedy(os.path.join(out, "onnx", name), p, NEW) for p in TJS_PROMPTS]
    assert client.node_greedy(out, TJS_PROMPTS, NEW, dtype=dtype)["tokens"] == expected
    if client.chromium():
        assert client.browser_greedy(out, TJS_PROMPTS, NEW, dtype=dtype)["tokens"] == expected


def test_a_quantized_head_is_no_lost_tie(tjs_folders):
    """config.json says tied; the q4 head holds the table's values as 4-bit codes: a tie up to rounding, not the lost
    tie inspect called it before (its next line then offered --lookup-from-head for the same pair)."""
    original, _ = tjs_folders
    data = json.loads(inspected(original, "--dtype", "q4", "--json", "--static").stdout)
    assert [e["kind"] for e in data["verdict"] if e["kind"] != "all_positions_scored"] == ["quantized_copy"]
    (entry,) = [v for v in data["across_files"]["vocabulary"] if v["kind"] == "token"]
    assert entry["tie_finding"] is None and entry["quantized_heads"] == [head_rows(onnx.load(
        os.path.join(original, "onnx", "model_q4.onnx")))[1]]


def test_a_transformersjs_folder_read_whole_names_each_variants_quantized_copy(tjs_folders):
    original, _ = tjs_folders
    said = unwrapped(inspected(original, "--static").stdout)  # every variant: the lines open with its dtype
    for dtype, size in (("q4", "128.0 KiB"), ("q4f16", "64.0 KiB")):  # 512 x 64 float32, float16: in the fix
        (line,) = [line for line in said if line.startswith(f"{dtype}: transformer.wte.weight: held again as head ")]
        fix = said[said.index(line) + 1]
        assert fix.startswith(f"  fix: --retie OUT --lookup-from-head (opt-in: saves {size} on disk"), fix
    assert sum(line.startswith("  fix: --retie OUT --lookup-from-head") for line in said) == 2


def test_a_zeroed_row_is_no_step_and_a_change_without_a_scale_is_infinite():
    from runtime.model.graph.quantized import steps
    found = steps(np.array([0.0, 1.0, 0.5, 0.0]), np.array([0.0, 0.0, 0.25, -0.5]))  # Gemma's zeroed padding row
    assert found.tolist() == [0.0, np.inf, 2.0, 0.0]


def test_the_greedy_prompts_come_from_the_models_tokenizer(tmp_path):
    """prompts_for: the model's tokenizer.json (at a transformers.js root above its onnx/ too, and no other parent)
    makes the texts ids, as a client
    encodes them; an id past the table, or no tokenizer, gives None (fixed ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from runtime.inspect.retie.headlookup import TEXTS, prompts_for
    words = sorted({w for text in TEXTS for w in text.replace(",", " ").replace("(", " ").replace(")", " ").split()})
    vocab = {w: i for i, w in enumerate(dict.fromkeys(["[UNK]"] + words + [",", "(", ")", ":"]))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    (tmp_path / "onnx").mkdir()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    expected = [tokenizer.encode(text).ids for text in TEXTS]
    assert prompts_for(str(tmp_path / "onnx" / "model_q4.onnx"), len(vocab)) is None  # no config.json: not a root
    (tmp_path / "config.json").write_text("{}")  # a transformers.js root: its onnx/ reads the root's files
    assert prompts_for(str(tmp_path / "onnx" / "model_q4.onnx"), len(vocab)) == expected
    assert prompts_for(str(tmp_path / "model.onnx"), len(vocab)) == expected
    assert prompts_for(str(tmp_path / "model.onnx"), 3) is None  # ids past a 3-row table
    assert prompts_for(str(tmp_path / "elsewhere" / "model.onnx"), len(vocab)) is None


def test_a_float16_scale_widened_the_wrong_way_fails_the_proof(tmp_path, monkeypatch, capsys):
    """q4f16: the head's rows computed from float16 scales each widened one float16 step off (what reading the
    scale's bits another way gives at its last place): the retied model's own lookup no longer matches them, and
    nothing is written."""
    from runtime.inspect import cli
    from runtime.inspect.retie import headlookup
    real = headlookup.quantized.decoded

    def off(model, q, t0, t1):
        exact, scales = real(model, q, t0, t1)
        wrong = (scales.astype(np.float16).view(np.uint16) + 1).view(np.float16).astype(np.float64)
        return exact / np.where(scales == 0, 1, scales) * wrong, wrong
    monkeypatch.setattr(headlookup.quantized, "decoded", off)
    status = cli.main([os.path.join(FIXTURES, "ortquant_q4f16"), "--retie", str(tmp_path / "out"),
                       "--lookup-from-head"], supervised=False)
    out = capsys.readouterr().out
    assert status == 1 and "not proven, nothing written" in out and not os.path.exists(tmp_path / "out")


def test_the_decoded_lookup_reads_zero_points_too(tmp_path):
    """A transformers.js folder whose q4 is the asymmetric quantizer's (zero points, block 16): the standard-op
    decode takes each row's zero points; its rows are the head's, decoded here, bit for bit."""
    import shutil
    from tests.fixtures import transformersjs_gpt2
    folder = transformersjs_gpt2.make(str(tmp_path / "gpt2"), dtypes=("q4",))
    shutil.copy(os.path.join(FIXTURES, "ortquant_q4_asym", "model.onnx"), os.path.join(folder, "onnx", "model_q4.onnx"))
    inspected(folder, "--retie", tmp_path / "out", "--lookup-from-head")
    original = onnx.load(os.path.join(folder, "onnx", "model_q4.onnx"))
    expected, _ = head_rows(original)
    retied = onnx.load(str(tmp_path / "out" / "onnx" / "model_q4.onnx"))
    assert not any(n.op_type == "GatherBlockQuantized" for n in retied.graph.node)
    session = ort.InferenceSession(str(tmp_path / "out" / "onnx" / "model_q4.onnx"))
    got = run(with_output(retied, "/transformer/wte/Gather_output_0"), str(tmp_path / "out" / "onnx"),
              all_ids_feeds(session, expected.shape[0]))["/transformer/wte/Gather_output_0"]
    assert np.array_equal(got.reshape(expected.shape).view(np.uint32), expected.view(np.uint32))
