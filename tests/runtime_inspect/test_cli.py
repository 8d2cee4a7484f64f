"""inspect's command line (runtime.inspect.cli): exit statuses, usage errors in one line before any work (bad
limits, a bad OUT, paths that are not UTF-8), closed standard streams, and progress on a terminal only."""
import os
import subprocess
import sys

import pytest

from tests.helpers import FIXTURES, ROOT, inspect_cli, one_line_error, refused, run_inspect, tied


def test_exit_codes_are_documented():
    code, out, _ = inspect_cli("--help")
    assert code == 0
    statuses = out.split("exit status:\n", 1)[1].splitlines()  # one status a line, none wrapped mid-sentence
    assert [line.split()[0] for line in statuses if not line.startswith("       ")] == ["0", "1", "2", "130,"]
    assert "0    the report written" in out and "1    the retie proof failed" in out and "2    bad usage" in out
    assert "--timeout" in out and "--memory-limit" in out


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_bad_limits_are_usage_errors(value):
    code, _, err = inspect_cli(os.path.join(FIXTURES, "torchscript_tied.onnx"), "--timeout", value)
    assert one_line_error(code, err, "positive number")


@pytest.mark.parametrize("flag, value", [("--timeout", "1e20"), ("--memory-limit", "1e300"), ("--timeout", "inf")])
def test_limits_that_would_overflow_are_refused(flag, value):
    done = run_inspect(os.path.join(FIXTURES, "torchscript_tied.onnx"), flag, value)
    assert refused(done) and "up to 1e+06" in done.stderr, done.stderr


def test_a_tiny_memory_limit_is_a_usage_error(tmp_path):
    code, _, err = inspect_cli(tied(tmp_path / "m.onnx"), "--memory-limit", "0.000001")
    assert one_line_error(code, err, "at least 0.25 GiB")


@pytest.mark.parametrize("out, message", [("", "needs a file name for OUT"), ("{tmp}/newdir/", "a folder"),
                                          ("{tmp}", "a folder")])
def test_retie_refuses_a_bad_out_before_any_work(tmp_path, out, message):
    done = run_inspect(os.path.join(FIXTURES, "torchscript_tied.onnx"), "--retie", out.format(tmp=tmp_path))
    assert refused(done) and message in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []


def test_paths_that_are_not_utf8_are_refused_in_one_line(tmp_path):
    model = os.path.join(FIXTURES, "torchscript_tied.onnx")
    bad = os.fsdecode(bytes(tmp_path) + b"/o\xff.onnx")
    code, _, err = inspect_cli(model, "--retie", bad)
    assert one_line_error(code, err, "OUT", "not UTF-8")
    done = subprocess.run([sys.executable, "-m", "graphs.export", os.fsdecode(bytes(tmp_path) + b"/d\xff")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert one_line_error(done.returncode, done.stderr, "DIR", "not UTF-8") and os.listdir(tmp_path) == []


def test_closed_standard_streams_are_an_answer_not_a_traceback(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    model = os.path.join(FIXTURES, "torchscript_tied.onnx")
    env = dict(os.environ, TMPDIR=str(scratch))
    closed_out = subprocess.run(f"{sys.executable} -m runtime.inspect {model} >&-", shell=True, cwd=ROOT, env=env,
                                capture_output=False, stderr=subprocess.PIPE, text=True, timeout=300)
    assert closed_out.returncode == 2 and "standard output is closed" in closed_out.stderr, closed_out.stderr
    closed_err = subprocess.run(f"{sys.executable} -m runtime.inspect {model} 2>&-", shell=True, cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, text=True, timeout=300)
    assert closed_err.returncode == 0 and "vocabulary:" in closed_err.stdout
    assert os.listdir(scratch) == []


def test_progress_shows_on_a_terminal_only(tmp_path):
    import pty
    path = os.path.join(FIXTURES, "genai_fp32", "model.onnx")
    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "runtime.inspect", path], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    out = process.communicate(timeout=300)[0]
    os.close(master)
    assert process.returncode == 0 and b"vocabulary:" in out
    assert b"\r[" in seen and b"in a child: running it once" in seen and seen.endswith(b"\r")  # cleared at the end
    assert run_inspect(path).stderr == ""  # not a terminal: silent


def test_the_default_timeout_grows_with_the_models_bytes(tmp_path):
    # issue 38: a fixed 600 s stopped models of 12-20 GiB that this machine can run
    from runtime.inspect.sandbox import isolated
    (tmp_path / "model.onnx").write_bytes(b"x" * 1000)
    assert isolated.default_timeout(str(tmp_path / "model.onnx")) == 600
    with open(tmp_path / "model.onnx.data", "wb") as f:
        f.truncate(3 * 2**30 - 1000)  # its size is what counts: 3 GiB in all
    os.mkfifo(tmp_path / "pipe")  # no size, never opened
    assert isolated.default_timeout(str(tmp_path / "model.onnx")) == 600 + 60 * 2
    assert isolated.default_timeout(str(tmp_path)) == 600 + 60 * 2


def test_checks_last_line_says_why_it_failed_or_that_it_passed(tmp_path):
    import json

    from runtime.bench import scale_model
    path = str(tmp_path / "m.onnx")  # a head holding the table transposed: stored twice, prepacked at load
    scale_model.generate(path, 1, vocab=300, width=16, hidden=32)
    data = json.loads(run_inspect(path, "--json").stdout)
    (pair,) = [p for p in data["pairs"] if p["relation"] != "distinct"]
    (entry,) = data["vocabulary"]
    done = run_inspect(path, "--check")
    fail, last = done.stdout.splitlines()[-2:]
    assert entry["tables_in_memory"] == 2 and pair["wasted_bytes"] == 300 * 16 * 4
    verdict, scored = data["verdict"]  # stored twice: one entry (it is held twice too), failing --check
    assert verdict == {"kind": "stored_more_than_once", "table": pair["table"], "file": path, "copies_on_disk": 2,
                       "copies_in_memory": 2, "wasted_bytes_on_disk": 19200, "wasted_bytes_in_memory": 19200,
                       "fix": "--retie OUT", "why_not": None}
    assert scored["kind"] == "all_positions_scored"  # informational: --check does not fail on it
    assert fail == f"--check: FAIL {pair['table']} stored twice (18.8 KiB wasted on disk)"
    assert done.returncode == 1 and last == f"--check: failed (1): {pair['table']} stored twice", last
    done = run_inspect(path, "--check", "--json")  # the JSON alone on stdout, the verdict on stderr
    assert done.returncode == 1 and json.loads(done.stdout)["pairs"] and done.stderr.splitlines()[-1] == last
    once = tied(tmp_path / "tied.onnx")
    done = run_inspect(once, "--check")
    assert done.returncode == 0 and done.stdout.splitlines()[-1].startswith("--check: passed"), done.stdout
