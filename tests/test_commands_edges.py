"""compare, graphs.export, bench and embed.py at their edges: sizes they cannot hold, output paths they cannot
write, and signals mid-run. Each is one line and exit 2 (or 143) before or instead of the work, nothing left."""
import os
import signal
import subprocess
import sys
import time

import onnx
import pytest

from graphs.outputs import umask, write_text
from tests.helpers import ROOT, one_line_error


def command(*args, timeout=120, **kwargs):
    done = subprocess.run([*args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs)
    return done.returncode, done.stdout, done.stderr


def physical():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize("args, words", [
    (["--json", "{tmp}"], ["--json", "a folder"]),
    (["--json", "{tmp}/missing/out.json"], ["no such folder"]),
    (["--json", ""], ["--json", "a folder or nothing"]),
    (["--export", "{tmp}/held"], ["gather_lookup.onnx.data exists", "refusing to overwrite"]),
    (["--export", "{tmp}/file"], ["--export", "is not a folder"]),
])
def test_compare_refuses_an_output_it_cannot_write_before_the_run(tmp_path, args, words):
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "gather_lookup.onnx.data").write_bytes(b"a user's data")
    (tmp_path / "file").write_text("x")
    before = sorted(os.listdir(tmp_path))
    start = time.monotonic()
    code, _, err = command(sys.executable, "-m", "runtime.compare", *[a.format(tmp=tmp_path) for a in args])
    assert one_line_error(code, err, *words), err
    assert time.monotonic() - start < 30  # at parsing, not after the run
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "held") == ["gather_lookup.onnx.data"]


def test_compare_takes_a_negative_seed_as_the_table_does():
    code, _, err = command(sys.executable, "-m", "runtime.compare", "--seed", "-1", "--vocab-size", "64", "--width",
                           "8", "--format", "int4", timeout=300)
    assert code == 0 and "Traceback" not in err, err


def test_compare_json_follows_the_umask(tmp_path):
    out = tmp_path / "r.json"
    code, _, err = command(sys.executable, "-m", "runtime.compare", "--vocab-size", "64", "--width", "8",
                           "--format", "float32", "--json", str(out), timeout=300)
    assert code == 0, err
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask()
    assert sorted(os.listdir(tmp_path)) == ["r.json"]


@pytest.mark.parametrize("args", [["--vocab-size", "16384"], ["--vocab-size", "50000", "--width", "256"]],
                         ids=["here", "rerun-on-huge-pages"])
def test_sigterm_mid_compare_leaves_nothing(tmp_path, args):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "runtime.compare", *args], cwd=ROOT, text=True,
                               env=dict(os.environ, TMPDIR=str(scratch)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not [n for n in os.listdir(scratch) if n.startswith("pymp-")] and time.monotonic() < deadline:
        time.sleep(0.05)  # its second process is up
    time.sleep(0.5)  # and at work: here about 4 s of it are left (a 4096 table once finished within a second on CI)
    assert process.poll() is None, "compare finished before the signal: the test proves nothing, use a larger table"
    process.send_signal(signal.SIGTERM)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == 143 and err.count("\n") == 1 and "terminated" in err, err
    assert not [n for n in os.listdir(scratch) if n.startswith(("onnx-lab-", "pymp-", "tmp"))]
    time.sleep(0.5)
    assert subprocess.run(["pgrep", "-f", str(scratch)], capture_output=True, text=True).stdout == ""


def test_export_refuses_a_size_it_cannot_hold_naming_the_bytes(tmp_path):
    code, _, err = command(sys.executable, "-m", "graphs.export", str(tmp_path / "out"), "--vocab-size", "100000",
                           "--width", "100000")
    need = 10 * 4 * 100000 * 100000  # the README's "about 10 float32 tables at once"
    assert one_line_error(code, err, f"would need about {need} bytes", "this machine has")
    assert err.startswith("python -m graphs.export: error: --vocab-size 100000 x --width 100000 ")  # as argparse's
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, words", [(["--vocab-size", "1"], "--vocab-size must be >= 2 (the neighbours graphs"),
                                         (["--vocab-size", "0"], "--vocab-size must be >= 2 (the neighbours graphs"),
                                         (["--width", "0"], "--width must be >= 1, got 0")])
def test_export_and_compare_refuse_the_same_smallest_table_in_the_same_words(tmp_path, args, words):
    for prog, module, *first in (("python -m graphs.export", "graphs.export", str(tmp_path / "out")),
                                 ("python -m runtime.compare", "runtime.compare")):
        code, out, err = command(sys.executable, "-m", module, *first, *args)
        assert one_line_error(code, err, words) and err.startswith(f"{prog}: error: ") and out == "", err
    assert not (tmp_path / "out").exists()


def test_export_and_compare_take_the_smallest_table_and_one_default_block_size(tmp_path):
    code, _, err = command(sys.executable, "-m", "graphs.export", str(tmp_path / "int8"), "--vocab-size", "2",
                           "--width", "64", "--format", "int8")
    assert code == 0, err
    scale = [t for t in onnx.load(str(tmp_path / "int8" / "tied_logits.onnx")).graph.initializer
             if t.name == "embedding_scale"][0]
    assert list(scale.dims) == [2, 64 // 32]  # one scale per 32 columns, as compare's default
    code, out, err = command(sys.executable, "-m", "runtime.compare", "--vocab-size", "2", "--width", "64", "--ids",
                             "0,1", "--format", "int8", "--json", "-", timeout=300)
    assert code == 0 and '"block_size": 32' in out, err
    for module in ("graphs.export", "runtime.compare"):  # and each --help says so, and what DIR / --export does
        helped = command(sys.executable, "-m", module, "--help")[1]
        assert "(default 32, as " in " ".join(helped.split()) and ">= 2" in helped
        assert "created if missing" in " ".join(helped.split())


def test_export_into_a_folder_holding_a_data_file_is_refused(tmp_path):
    (tmp_path / "tied_logits.onnx.data").write_bytes(b"a user's data")
    code, _, err = command(sys.executable, "-m", "graphs.export", str(tmp_path))
    assert one_line_error(code, err, "tied_logits.onnx.data exists", "--force")
    assert os.listdir(tmp_path) == ["tied_logits.onnx.data"]


@pytest.mark.slow
def test_sigterm_during_an_export_save_leaves_no_staged_file(tmp_path):
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "graphs.export", str(out), "--vocab-size", "131072",
                                "--width", "512"], cwd=ROOT, text=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out.exists() and [n for n in os.listdir(out) if n.startswith(".saving-")]):
        time.sleep(0.01)  # caught mid-save
    process.send_signal(signal.SIGTERM)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == 143 and "terminated" in err and "Traceback" not in err, err
    left = os.listdir(out)
    assert not [n for n in left if n.startswith(".saving-")]
    for name in left:  # what was placed is whole: each model has the data file it names
        if name.endswith(".onnx"):
            onnx.load(str(out / name))


def test_embed_refuses_a_size_it_cannot_hold_on_a_bare_python():
    vocab = physical() // (3 * 32 * 100) + 1
    code, _, err = command(sys.executable, "-I", "-S", "embed.py", "--vocab-size", str(vocab), "--width", "100")
    assert one_line_error(code, err, "embed.py", "would need about", "this machine has")


def test_bench_refuses_outputs_it_cannot_write_before_measuring(tmp_path):
    for args, words in ((["--json", str(tmp_path)], ["a folder"]), (["--json", str(tmp_path / "no" / "x.json")],
                                                                      ["no such folder"])):
        start = time.monotonic()
        code, _, err = command(sys.executable, "-m", "runtime.bench", "--quick", *args)
        assert one_line_error(code, err, *words), err
        assert time.monotonic() - start < 30


def test_reports_are_written_atomically_with_the_users_mode(tmp_path):
    old = os.umask(0o027)
    try:
        write_text(str(tmp_path / "r.json"), "{}\n")  # bench --json and compare --json write through this
        assert os.stat(tmp_path / "r.json").st_mode & 0o777 == 0o640
        with pytest.raises(TypeError):
            write_text(str(tmp_path / "s.json"), None)  # fails mid-write: nothing staged is left
    finally:
        os.umask(old)
    assert os.listdir(tmp_path) == ["r.json"]


@pytest.mark.parametrize("module, name", [("runtime.inspect.cli", "onnx-lab-inspect"),
                                          ("runtime.compare.cli", "onnx-lab-compare"), ("graphs.export", "onnx-lab-export")])
def test_an_installed_command_names_itself(module, name):
    """pyproject.toml's scripts call console() with sys.argv[0] the installed command's path."""
    code = f"import sys; sys.argv[:] = ['/usr/local/bin/{name}', '--no-such-option']; from {module} import console; console()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith(f"{name}: error: ") and done.stderr.count("\n") == 1
    code = f"import sys; sys.argv[:] = ['/usr/local/bin/{name}', '--help']; from {module} import console; console()"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60).stdout.startswith(f"usage: {name} ")
