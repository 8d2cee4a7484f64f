"""What inspect's report says (runtime.inspect.report): the words of its lines, names escaped so a model cannot
write to the terminal, and --json equal to what the module's API finds."""
import json
import os

import onnx
import pytest

import graphs
from runtime import inspect
from runtime.inspect.report import as_json
from tests.helpers import (
    FIXTURES,
    TORCH_TABLE_BYTES,
    findings,
    inspect_cli,
    inspected,
    one_line_error,
    renamed,
    run_inspect,
    unwrapped,
)

HOSTILE = "emb\x1b]0;pwned\x07\x1b[2J\nvocabulary: forged\u2028x"


def test_names_cannot_write_to_the_terminal(tmp_path):
    path = tmp_path / "esc.onnx"
    onnx.save(renamed(graphs.tied_logits(graphs.make_table(16, 8)), "embedding", HOSTILE), path)
    code, out, err = inspect_cli(path)
    assert code == 0, err
    assert not any(c in out for c in "\x1b\x07\u2028") and "\\x1b]0;pwned\\x07" in out
    assert not any(line.startswith("vocabulary: forged") for line in out.splitlines())
    # on an ASCII terminal: the same report, every character of the name escaped (U+2028 too), nothing on stderr
    done = run_inspect(path, env=dict(os.environ, PYTHONIOENCODING="ascii"))
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.isascii() and "\\u2028x 16 x 8 float32" in done.stdout
    assert "vocabulary: table emb\\x1b]0;pwned\\x07\\x1b[2J\\nvocabulary: forged\\u2028x 16 x 8" in done.stdout
    assert not any(line.startswith("vocabulary: forged") for line in done.stdout.splitlines())


def test_control_characters_in_arguments_are_escaped(tmp_path):
    model = os.path.join(FIXTURES, "torchscript_tied.onnx")
    code, _, err = inspect_cli(model, "--bogus\x1b[2J")
    assert one_line_error(code, err, "\\x1b[2J") and "\x1b" not in err


def test_inspect_summarises_small_runtime_copies_under_verbose():
    model = os.path.join(FIXTURES, "genai_fp32", "model.onnx")
    out = inspected(model, "--verbose").stdout
    assert "runtime copies under 4096 bytes: 2 (folded constants), 16 bytes in all" in out
    copy = "/model/embed_tokens/Transpose/output_0 transposed, 128.0 KiB"  # the table's, 512 x 64 float32
    assert copy in " ".join(unwrapped(out))
    short = inspected(model).stdout  # without it: the copy of the table, not the folded constants
    assert "runtime copies under" not in short and copy in " ".join(unwrapped(short))


def test_retie_reports_bytes_saved(tmp_path):
    model, out = os.path.join(FIXTURES, "torchscript_tied.onnx"), tmp_path / "r.onnx"
    done = run_inspect(model, "--retie", out)
    assert done.returncode == 0 and max(len(x) for x in done.stdout.splitlines()) <= 100, done.stdout
    saved = os.path.getsize(model) - sum(os.path.getsize(p) for p in tmp_path.iterdir())
    # one table, less what the tie's run-time view adds: its nodes and shape constants, named after the table
    before, after = onnx.load(model), onnx.load(str(out))
    added = sum(n.ByteSize() for n in after.graph.node if n.name not in {m.name for m in before.graph.node}) + sum(
        t.ByteSize() for t in after.graph.initializer if t.name not in {i.name for i in before.graph.initializer})
    assert added < 4096 and all(t.name.startswith("embed.weight.") for t in after.graph.initializer
                                if t.name not in {i.name for i in before.graph.initializer})
    assert TORCH_TABLE_BYTES - added - 256 <= saved <= TORCH_TABLE_BYTES  # 256: the fields that frame them
    (line,) = [x for x in unwrapped(done.stdout) if x.startswith("retie: wrote")]
    assert line.endswith(f" on disk (saved {saved / 1024:.1f} KiB)"), line


# the figures that move between runs
MEASURED = ("resident_bytes", "anonymous_bytes", "file_bytes", "peak_bytes", "kept_bytes", "times_table")


def unmeasured(vocabulary):
    """Vocabulary entries without the resident-memory figures, which no two sessions share."""
    return [{**v, "in_memory": {side: {k: x for k, x in held.items() if k not in MEASURED}
                                for side, held in v["in_memory"].items()}} for v in vocabulary]


@pytest.mark.parametrize("name", ["tied_logits.onnx", "untied_logits.onnx", "onehot_lookup.onnx"])
def test_inspect_module_api_matches_cli(exported, tmp_path, name):
    """inspect_model in this process and the command in its own find the same tables, heads, pairs and copies."""
    info = inspect.inspect_model(str(exported / name), str(tmp_path))
    assert [t.initializer for t in info.tables] == ["embedding"]
    assert [h.initializer for h in info.heads] == {"tied_logits.onnx": ["embedding"],
                                                         "untied_logits.onnx": ["lm_head"]}.get(name, [])
    api = json.loads(json.dumps(as_json(info, verdict=False)))  # as --json writes it: tuples become lists
    cli = findings(exported / name)
    for key in ("onnxruntime", "file_bytes", "initializers", "pairs", "runtime_copies"):
        assert cli[key] == api[key], key
    assert unmeasured(cli["vocabulary"]) == unmeasured(api["vocabulary"])
    assert [(p["table"], p["head"]) for p in cli["pairs"]] == [(t.initializer, h.initializer)
                                                               for t in info.tables for h in info.heads]


def test_the_default_report_says_each_pair_once():
    # Optimum's GPT-2: the table transformer.wte.weight and the head onnx::MatMul_407 its transposed copy (the
    # graph says so: a Gather reads one, lm_head's MatMul the other, and their values are each other's transpose)
    model = onnx.load(os.path.join(FIXTURES, "optimum_gpt2", "model.onnx"))
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    table, head = "transformer.wte.weight", "onnx::MatMul_407"
    assert (weights[table].T == weights[head]).all()
    code, out, err = inspect_cli(os.path.join(FIXTURES, "optimum_gpt2", "model.onnx"))
    assert code == 0, err
    body = unwrapped(out.split("\n\n", 1)[1])  # past the verdict, which names the fix
    both = [line for line in body if table in line and head in line]
    assert len(both) == 1 and both[0].startswith("vocabulary: table "), both
    assert not [line for line in body if line.startswith(("pair ", "tables (", "logits heads ("))]
    code, out, err = inspect_cli(os.path.join(FIXTURES, "optimum_gpt2", "model.onnx"), "--verbose")
    assert code == 0, err
    verbose = unwrapped(out)  # the inventory, every pair and reader, is --verbose's
    assert f"pair {table} / {head}: transposed_duplicate, 128.0 KiB wasted in the file" in verbose
    assert any(line.startswith("logits heads (") and head in line for line in verbose)
