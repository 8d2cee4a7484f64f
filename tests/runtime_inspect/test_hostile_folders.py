"""Hostile folders (issue 37): every name a layout, --files or a config gives is resolved once and must lie inside
the folder; the file opened is the file checked; --retie writes only under OUT; copies are counted by distinct
stored bytes; equal tables across many files are grouped, not paired; a hub cache snapshot is read in place."""
import hashlib
import json
import os
import resource
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import graphs
from graphs.together import check_names, save_together
from runtime.bench import scale_model
from runtime.model.read import paths
from runtime.model.read.text import InspectError
from tests.helpers import ROOT, findings, inspect_cli, many_tables, one_line_error, run_inspect, tied

V, D = 64, 8  # helpers.tied's table: 2048 bytes, saved to external data by save_together


def tree(root):
    """{relative path: sha1 of its bytes (or the link's target)} of every file and link under `root`."""
    found = {}
    for where, _, names in os.walk(root):
        for name in names:
            path = os.path.join(where, name)
            rel = os.path.relpath(path, root)
            found[rel] = ("link -> " + os.readlink(path)) if os.path.islink(path) else \
                hashlib.sha1(open(path, "rb").read()).hexdigest()
    return found


def two_copies(where, names=("a.onnx", "b.onnx")):
    """A folder holding the lab's tied model once per name: the same table stored in every file."""
    os.makedirs(where, exist_ok=True)
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(where, name)), exist_ok=True)
        tied(os.path.join(where, name), V, D)
    return where


def loads_and_runs(path):
    """Run the model at `path` in onnxruntime on a few ids: the lookup's rows (a retied OUT must still load)."""
    session = ort.InferenceSession(str(path))
    feeds = {i.name: (np.array([[1, 5, 9]], np.int64) if i.name == "ids" else np.ones((1, 3, D), np.float32))
             for i in session.get_inputs()}
    return session.run(None, feeds)[0]


# --- it never writes onto the user's model ---------------------------------------------------------------------------

def test_files_named_absolutely_are_the_folders_own_and_retie_writes_only_out(tmp_path):
    # failed before issue 37: a.onnx and b.onnx rewritten in place, M/model.data made, OUT empty, exit 0
    model = two_copies(tmp_path / "M")
    before = tree(tmp_path)
    out = tmp_path / "OUT"
    done = run_inspect(model, "--files", f"{model / 'a.onnx'},{model / 'b.onnx'}", "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert tree(model) == {k[2:]: v for k, v in before.items() if k.startswith("M/")}  # input untouched
    assert sorted(os.listdir(out)) == ["a.onnx", "b.onnx", "model.data"]
    assert sorted(os.listdir(tmp_path)) == ["M", "OUT"]
    table = graphs.make_table(V, D)
    for name in ("a.onnx", "b.onnx"):
        assert np.array_equal(loads_and_runs(out / name).view(np.uint32), table[[1, 5, 9]][None].view(np.uint32))


def test_a_genai_config_naming_the_folder_by_its_own_name_writes_nothing_into_it(tmp_path):
    # failed before issue 37: model.onnx truncated and rewritten through "../m/model.onnx"
    model = two_copies(tmp_path / "m", ("model.onnx", "embeds.onnx"))
    (model / "genai_config.json").write_text(json.dumps(
        {"model": {"decoder": {"filename": "../m/model.onnx"}, "embedding": {"filename": "embeds.onnx"}}}))
    before = tree(model)
    out = tmp_path / "out"
    done = run_inspect(model, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert tree(model) == before
    assert sorted(os.listdir(out)) == ["embeds.onnx", "genai_config.json", "model.data", "model.onnx"]
    config = json.load(open(out / "genai_config.json"))  # names OUT's own files, not the original's
    assert (config["model"]["decoder"]["filename"], config["model"]["embedding"]["filename"]) == (
        "model.onnx", "embeds.onnx")


def test_files_named_through_the_parent_are_written_inside_out(tmp_path):
    # failed before issue 37: a.onnx and model.data written beside OUT, outside it
    model = two_copies(tmp_path / "m")
    (tmp_path / "o").mkdir()
    out = tmp_path / "o" / "out"
    before = tree(tmp_path)
    done = run_inspect(model, "--files", "../m/a.onnx,b.onnx", "--retie", out, cwd=model)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("o/out/")} == before
    assert sorted(os.listdir(out)) == ["a.onnx", "b.onnx", "model.data"]


def test_a_decoder_named_like_the_shared_data_file_gets_another_data_file(tmp_path):
    # failed before issue 37: the decoder written over OUT's model.data, exit 0, OUT did not load
    model = two_copies(tmp_path / "m", ("embeds.onnx", "model.data"))
    out = tmp_path / "out"
    done = run_inspect(model, "--files", "embeds.onnx,model.data", "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(out)) == ["embeds.onnx", "model.data", "model.data.1"]
    table = graphs.make_table(V, D)
    for name in ("embeds.onnx", "model.data"):
        assert np.array_equal(loads_and_runs(out / name).view(np.uint32), table[[1, 5, 9]][None].view(np.uint32))


@pytest.mark.parametrize("names, words", [
    (["/abs/a.onnx"], "absolute"), (["../a.onnx"], "'..'"), (["a/./b.onnx"], "'.'"), (["x/model.data"], "data file"),
    (["a.onnx", "a.onnx"], "twice"), (["a.onnx", "a.onnx/b.onnx"], "folder of")])
def test_save_together_refuses_names_that_leave_its_folder_or_collide(names, words, tmp_path):
    model = graphs.tied_logits(graphs.make_table(V, D))
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        save_together([(n, model, None) for n in names], tmp_path / "out")
    assert os.listdir(tmp_path) == []  # nothing staged, nothing written
    check_names(["a.onnx", "sub/b.onnx", "sub/c.onnx"], "model.data")  # and these are fine


# --- it never reads outside the folder -------------------------------------------------------------------------------

def test_a_file_swapped_for_a_link_out_after_the_layout_check_is_not_read(tmp_path, monkeypatch):
    # failed before issue 37: ../secret.onnx read, run and its names printed (containment checked in client_files only)
    from runtime.inspect import examine_folder
    from runtime.model.read import layout
    model = two_copies(tmp_path / "m")
    graphs.save(graphs.tied_logits(graphs.make_table(V, D, seed=7)), tmp_path / "secret.onnx")
    real = layout.client_files

    def then_swapped(folder, chosen=None):  # the check passes; then b.onnx becomes a link out of the folder
        answer = real(folder, chosen)
        os.remove(model / "b.onnx")
        os.symlink(tmp_path / "secret.onnx", model / "b.onnx")
        return answer
    monkeypatch.setattr(examine_folder, "client_files", then_swapped)
    with pytest.raises(InspectError, match="not inside .* when opened"):
        examine_folder.inspect_folder(str(model), str(tmp_path), None, static=True)


def test_a_model_read_by_the_child_is_refused_if_its_link_now_leads_out(tmp_path):
    from runtime.model.read.checked import Changed, source
    from runtime.model.read.model import load
    model = two_copies(tmp_path / "m")
    checked = load(str(model / "a.onnx"), root=str(model)).checked
    graphs.save(graphs.tied_logits(graphs.make_table(V, D)), tmp_path / "same.onnx")  # the same bytes, outside
    os.remove(model / "a.onnx")
    os.symlink(tmp_path / "same.onnx", model / "a.onnx")
    with pytest.raises(Changed, match="not inside"):
        source(checked)


def test_a_fifo_named_by_genai_config_is_not_a_regular_file(tmp_path):
    model = two_copies(tmp_path / "m", ("model.onnx",))
    os.mkfifo(model / "pipe.onnx")
    (model / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "pipe.onnx"}}}))
    code, _, err = inspect_cli(model, timeout=60)
    assert one_line_error(code, err, "pipe.onnx", "not a regular file")


# --- counts that add up ----------------------------------------------------------------------------------------------

def test_four_files_naming_one_range_of_one_data_file_hold_it_once(tmp_path):
    # failed before issue 37: "held -2 times" (one subtracted per pair of files: 6 for 4)
    model = graphs.tied_logits(graphs.make_table(V, D))
    where = tmp_path / "four"
    save_together([(f"{c}.onnx", model, None) for c in "abcd"], where)
    (entry,) = findings(where)["across_files"]["vocabulary"]
    per_file = [f["vocabulary"][0]["tables_in_memory"] for f in findings(where)["files"]]
    assert per_file == [1, 1, 1, 1]  # the tied head reads the table itself: no session copies it
    assert (entry["copies_on_disk"], entry["in_memory"]["defaults"]["copies"],
            entry["in_memory"]["no_prepacking"]["copies"]) == (1, 1, 1)
    assert run_inspect(where, "--check").returncode == 0


def test_one_file_named_twice_is_one_file(tmp_path):
    # failed before issue 37: "stored 2 times", --check exit 1
    model = two_copies(tmp_path / "m", ("a.onnx",))
    data = findings(model, "--files", "a.onnx,./a.onnx,sub/../a.onnx", "--static")
    assert [f["path"] for f in data["files"]] == ["a.onnx"]
    assert data["across_files"]["vocabulary"][0]["copies_on_disk"] == 1
    assert run_inspect(model, "--files", "a.onnx,./a.onnx", "--check").returncode == 0


def test_many_identical_files_are_one_group_not_pairs(tmp_path):
    # failed before issue 37: every cross-file pair related and printed, n(n-1)/2 (800 files: 330 000 lines)
    n = 60
    model = two_copies(tmp_path / "m", [f"f{i:02d}.onnx" for i in range(n)])
    data = findings(model, "--static")
    pairs = data["across_files"]["pairs"]
    assert len(pairs) == n - 1 and {p["a"]["file"] for p in pairs} == {"f00.onnx"}
    assert {p["b"]["file"] for p in pairs} == {f"f{i:02d}.onnx" for i in range(1, n)}
    assert data["across_files"]["vocabulary"][0]["copies_on_disk"] == n
    report = run_inspect(model, "--static", "--verbose").stdout
    lines = report.splitlines()
    (at,) = [i for i, x in enumerate(lines) if "files hold the same table" in x]
    assert lines[at] == f"{n} files hold the same table as f00.onnx embedding"
    wasted = (n - 1) * V * D * 4  # 2048 bytes a copy: KiB
    assert lines[at + 1].startswith(f"  {n - 1} duplicate; {wasted / 1024:.1f} KiB wasted on disk; in f01.onnx, ")
    named = lines[at + 1].split("; in ")[1].split(" and ")
    shown = named[0].split(", ")
    assert shown == [f"f{i:02d}.onnx" for i in range(1, len(shown) + 1)] and named[1] == f"{n - 1 - len(shown)} more"
    assert len(lines[at + 1]) < 100
    assert not [x for x in report.splitlines() if x.startswith("pair f")]  # no pair of files printed


def test_many_equal_tables_in_one_file_are_a_line_not_n_squared(tmp_path):
    # failed before issue 37: one pair line per table/head pair of equal values (495 000 lines for two files)
    same = many_tables(30)
    first = {t.name: numpy_helper.to_array(t) for t in same.graph.initializer}
    for t in same.graph.initializer:  # every table the same values, every head their transpose
        t.CopyFrom(numpy_helper.from_array(first["t0"] if t.name.startswith("t") else first["t0"].T.copy(), t.name))
    onnx.save(same, tmp_path / "same.onnx")
    data = findings(tmp_path / "same.onnx", "--static")
    assert sum(p["relation"] == "transposed_duplicate" for p in data["pairs"]) == 30 * 30
    report = run_inspect(tmp_path / "same.onnx", "--static").stdout.splitlines()
    assert max(len(x) for x in report) <= 100
    assert not [x for x in report if x.startswith("pair ")]
    (at,) = [i for i, x in enumerate(report) if "hold the same values" in x]
    assert report[at] == "30 table(s) (t0, ...) and 30 head(s) (h0, ...) hold the same values:"
    assert report[at + 1] == f"  900 pairs, 900 transposed_duplicate; {30 * 8 * 4 * 4 / 1024:.1f} KiB wasted in the file"


@pytest.mark.slow
def test_the_lab_int8_tied_decoder_beside_a_float_lookup_is_a_quantized_copy_across_files(tmp_path):
    # failed before issue 37: the head's entry dropped because it reads the same tensor as its lookup
    table = graphs.make_table(256, 32)
    where = tmp_path / "m"
    where.mkdir()
    graphs.save(graphs.gather_lookup(table), where / "embed_tokens.onnx")
    graphs.save(graphs.tied_logits(table, fmt="int8"), where / "decoder.onnx")
    data = findings(where, "--files", "embed_tokens.onnx,decoder.onnx", "--static")
    relations = {(p["a"]["file"], p["b"]["file"], p["relation"]) for p in data["across_files"]["pairs"]}
    assert ("embed_tokens.onnx", "decoder.onnx", "quantized_copy") in relations


# --- the smaller ones ------------------------------------------------------------------------------------------------

def test_progress_lines_escape_a_file_names_control_characters(tmp_path):
    # failed before issue 37: "reading and checking <path>" wrote the name's OSC / BEL / clear-screen raw
    import pty
    name = tmp_path / "x\x1b]0;owned\x07\x1b[2J.onnx"
    tied(name, V, D)
    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "runtime.inspect", str(name), "--static"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    process.communicate(timeout=120)
    os.close(master)
    assert process.returncode == 0 and b"reading and checking" in seen
    assert b"\x1b]0;" not in seen and b"\x07" not in seen and b"\x1b[2J" not in seen and b"\\x1b]0;owned\\x07" in seen


def test_with_json_a_retie_that_fails_leaves_only_its_error_on_stderr(tmp_path, monkeypatch, capsys):
    # failed before issue 37: the retie's own lines reached stderr before its error (3 lines, exit 2)
    from runtime.inspect import cli
    from runtime.inspect.analysis import Analysis

    def says_then_fails(result, out, scratch, limits, say, asked=None):
        say("retie: a.onnx: planned\n")
        raise InspectError("no space for OUT")
    monkeypatch.setattr(cli, "retie_folder", says_then_fails)
    model = two_copies(tmp_path / "m")
    status = cli.main([str(model), "--static", "--json"], supervised=False)
    assert status == 0 and json.loads(capsys.readouterr().out)["files"]
    monkeypatch.setattr(cli, "analyse", lambda *a, **k: Analysis("folder", {"items": []}, []))
    monkeypatch.setattr(cli, "folder_json", lambda result: {})
    status = cli.main([str(model), "--json", "--retie", str(tmp_path / "out")], supervised=False)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "no space for OUT" in err and "planned" not in err


def test_retie_out_with_a_trailing_slash_is_a_folder_for_a_folder(tmp_path):
    # failed before issue 37: refused with the single-file message ("a folder or nothing; name the file")
    model = two_copies(tmp_path / "m")
    done = run_inspect(model, "--retie", f"{tmp_path / 'out'}/")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["a.onnx", "b.onnx", "model.data"]


def test_a_decoder_in_a_subfolder_gets_its_configs_in_out(tmp_path):
    # failed before issue 37: no genai_config.json / config.json in OUT, and no line saying so
    model = two_copies(tmp_path / "m", ("sub/model.onnx", "sub/embeds.onnx"))
    (model / "genai_config.json").write_text(json.dumps(
        {"model": {"decoder": {"filename": "sub/model.onnx"}, "embedding": {"filename": "sub/embeds.onnx"}}}))
    (model / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    out = tmp_path / "out"
    done = run_inspect(model, "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(tree(out)) == ["config.json", "genai_config.json", "sub/embeds.onnx", "sub/model.data",
                                 "sub/model.onnx"]
    assert "copied genai_config.json into OUT" in done.stdout and "copied config.json into OUT" in done.stdout
    assert json.load(open(out / "genai_config.json"))["model"]["decoder"]["filename"] == "sub/model.onnx"


def test_a_shells_file_size_limit_is_named_not_the_model(tmp_path):
    # failed before issue 37: "onnxruntime cannot load it" for a valid model under `ulimit -f`
    path = str(tmp_path / "model.onnx")  # 32 KiB of table, and a head holding it transposed: --retie writes more
    scale_model.generate(path, 1, vocab=256, width=32, hidden=32)
    limit = 16 * 1024

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    code, _, err = inspect_cli(path, preexec_fn=limited)
    assert code == 0, err  # inspect writes no tensor data (issue 38: the optimized model's layout only)
    code, _, err = inspect_cli(path, "--retie", tmp_path / "out.onnx", preexec_fn=limited)
    assert one_line_error(code, err, "file size limit", "ulimit -f") and "cannot load" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["model.onnx", "model.onnx.data"]


# --- Hugging Face's hub cache ----------------------------------------------------------------------------------------

def hub_snapshot(tmp_path, files):
    """A hub cache laid out as huggingface_hub writes it: models--org--name/blobs/<sha256> holding each file's
    bytes, snapshots/<rev>/<name> a relative link to its blob. `files` {name: bytes}."""
    repo = tmp_path / "hub" / "models--org--name"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(repo / "blobs" / blob, link.parent), link)
    return snapshot


def test_a_hub_cache_snapshot_is_inspected_in_place_and_retied_into_real_files(tmp_path):
    # failed before issue 37: refused outright, every file being a link out of the snapshot
    made = tmp_path / "made"
    made.mkdir()
    tied(made / "model.onnx", V, D, external=True)  # its table in model.onnx.data
    tied(made / "embeds.onnx", V, D)  # the same table again, inside the file
    files = {n: (made / n).read_bytes() for n in ("model.onnx", "embeds.onnx", "model.onnx.data")}
    files["genai_config.json"] = json.dumps({"model": {"decoder": {"filename": "model.onnx"},
                                                        "embedding": {"filename": "embeds.onnx"}}}).encode()
    snapshot = hub_snapshot(tmp_path, files)
    data = findings(snapshot)
    assert [f["path"] for f in data["files"]] == ["model.onnx", "embeds.onnx"]
    (entry,) = data["across_files"]["vocabulary"]
    assert (entry["copies_on_disk"], entry["in_memory"]["defaults"]["copies"]) == (2, 2)
    single = findings(snapshot / "model.onnx")  # one file of it: its data file found beside it, in the snapshot
    assert single["vocabulary"][0]["tables_in_memory"] == 1
    before = tree(tmp_path / "hub")
    out = tmp_path / "out"
    done = run_inspect(snapshot, "--files", "model.onnx,embeds.onnx,../0123abcd/model.onnx", "--retie", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert tree(tmp_path / "hub") == before
    assert sorted(os.listdir(out)) == ["embeds.onnx", "genai_config.json", "model.data", "model.onnx"]
    assert not [n for n in os.listdir(out) if os.path.islink(out / n)]  # real files, never links
    (entry,) = findings(out)["across_files"]["vocabulary"]
    assert (entry["copies_on_disk"], entry["in_memory"]["defaults"]["copies"]) == (1, 1)


def test_a_link_out_of_the_hub_repository_is_refused(tmp_path):
    tied(tmp_path / "elsewhere.onnx", V, D)
    snapshot = hub_snapshot(tmp_path, {"embeds.onnx": (tmp_path / "elsewhere.onnx").read_bytes()})
    os.symlink(tmp_path / "elsewhere.onnx", snapshot / "model.onnx")
    code, _, err = inspect_cli(snapshot, "--static")
    assert one_line_error(code, err, "model.onnx", "not inside")
    assert paths.hub_root(snapshot) == os.path.realpath(tmp_path / "hub" / "models--org--name")
    assert paths.hub_root(tmp_path) is None


def test_a_change_in_bytes_or_memory_reads_as_its_sign_says():
    # failed before issue 37: "saved -1489" where OUT was larger, and "was +-1.7 MiB" for a Pss that fell
    from runtime.inspect.retie.lines import disk_change
    from runtime.inspect.retie.outcomes import _say_memory
    assert (disk_change(9404, 7460), disk_change(6000, 7489)) == ("saved 1.9 KiB", "1.5 KiB more")
    said = []
    figures = lambda mib: {"resident_bytes": int(mib * 2**20), "copies": 1}
    was = {"in_memory": {"defaults": figures(-1.7)}, "copies_on_disk": 1, "bytes": 32 * 2**20}
    _say_memory([was], {"defaults": figures(0.4), "no_prepacking": figures(0.3)}, said.append)
    assert "+0.4 MiB Pss after a run of each (was -1.7; " in said[0] and "+-" not in said[0]
    _say_memory([dict(was, bytes=2**20)], {"defaults": figures(0.4), "no_prepacking": figures(0.3)}, said.append)
    assert said[1].endswith("was -1.7: the largest table, 1.0 MiB, is too small to show in it (copies counted "
                            "below)\n") and "+-" not in said[1]
    _say_memory([was], {"defaults": figures(0.4)}, said.append)  # --retie measures the defaults alone
    assert said[2].endswith("+0.4 MiB Pss after a run of each (was -1.7)\n")


def test_a_file_name_no_utf8_spells_is_retied(tmp_path):
    """A folder holding a file whose name is not UTF-8 (b'second_\\xff.onnx'): --retie exited 1 with pybind11's
    "incompatible constructor arguments" (the name's surrogate-escaped text given to onnxruntime). Now both files
    are retied and proven, the odd name kept, and the one table stored once."""
    import shutil
    from tests.helpers import FIXTURES
    folder = tmp_path / "m"
    folder.mkdir()
    source = os.path.join(FIXTURES, "torchscript_tied.onnx")
    shutil.copy(source, folder / "model.onnx")
    shutil.copy(source, os.fsencode(folder) + b"/second_\xff.onnx")
    done = run_inspect(folder, "--retie", tmp_path / "out")
    assert done.returncode == 0 and "incompatible" not in done.stdout + done.stderr, done.stdout + done.stderr
    names = sorted(os.listdir(os.fsencode(tmp_path / "out")))
    assert names == [b"model.data", b"model.onnx", b"second_\xff.onnx"]
    model = onnx.load(os.fsdecode(os.fsencode(tmp_path / "out") + b"/second_\xff.onnx"), load_external_data=False)
    assert any(n.op_type == "Gemm" for n in model.graph.node)  # its head retied: read from the one table
