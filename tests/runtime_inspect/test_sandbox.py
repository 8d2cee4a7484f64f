"""The sandbox (runtime.inspect.sandbox): onnxruntime in a child under limits, the guard around the command, the
feeds. A file changed after the parent checked it is never run; time-outs, memory limits (ours and the shell's),
signals and crashes each end in one line with a documented status, and nothing is left behind: no scratch folder,
no half-placed output, no child outliving the command."""
import glob
import json
import mmap
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphs
from runtime.model.read import checked as read_checked
from runtime.model.read.model import load
from runtime.model.read.text import InspectError
from runtime import feeds
from runtime.inspect.sandbox import guard, isolated, jobs
from tests.helpers import (
    FIXTURES,
    MADE,
    ROOT,
    findings,
    inspect_cli,
    many_tables,
    model_in,
    one_line_error,
    run_inspect,
    tied,
    token_entry,
    transposed_head,
)


# --- changed files ----------------------------------------------------------------------------------------------------

def test_a_model_swapped_after_the_check_is_never_run(tmp_path):
    path = tied(tmp_path / "m.onnx")
    model = load(path)
    tied(tmp_path / "other.onnx", seed=1)
    os.replace(tmp_path / "other.onnx", path)  # swapped between the parent's check and the child's load
    job = jobs.optimize(jobs.user_model(model.checked), str(tmp_path / "opt.onnx"), str(tmp_path))
    with pytest.raises(read_checked.Changed, match="changed after it was checked"):
        isolated.call(job, "building its optimized model", isolated.Limits(60), model.file_bytes)
    assert not os.path.exists(tmp_path / "opt.onnx")  # onnxruntime never saw it


def test_a_data_file_swapped_after_the_check_is_refused(tmp_path):
    path = tied(tmp_path / "m.onnx", external=True)
    model = load(path)
    data = graphs.storage.data_path(path)
    shutil.copy(data, str(data) + ".new")
    os.replace(str(data) + ".new", data)  # same bytes, another file: not the one checked
    with pytest.raises(read_checked.Changed, match="changed after it was checked"):
        read_checked.source(model.checked)
    model = load(path)
    checked = read_checked.source(model.checked)  # unchanged: the checked file, all of it in its shell (its
    assert checked.as_user() == (open(path, "rb").read(), model.folder)  # tensors lie in the data file)
    checked.close()


def test_what_the_child_runs_is_the_checked_bytes(tmp_path):
    path = tied(tmp_path / "m.onnx", external=True)
    model = load(path)
    with open(path, "r+b") as f:  # rewritten in place, same size, same inode: the digest tells
        data = bytearray(f.read())
        data[-1] ^= 1
        f.seek(0)
        f.write(data)
    with pytest.raises(read_checked.Changed):
        read_checked.source(model.checked)


def test_a_data_file_link_retargeted_after_the_check_is_refused(tmp_path):
    path = tmp_path / "m.onnx"
    model = graphs.tied_logits(graphs.make_table(64, 8))
    graphs.save(model, path, external=True)
    data = graphs.storage.data_path(path)
    os.rename(data, tmp_path / "real.data")
    shutil.copy(tmp_path / "real.data", tmp_path / "other.data")
    os.symlink("real.data", data)  # the model's location is a link to a file inside the folder
    checked = load(path).checked
    os.remove(data)
    os.symlink("other.data", data)  # retargeted: same bytes, another file, still inside
    with pytest.raises(read_checked.Changed, match="changed after it was checked"):
        read_checked.source(checked)


def test_a_file_truncated_while_mapped_is_one_line_not_sigbus(tmp_path, capsys):
    data = tmp_path / "data.bin"
    data.write_bytes(b"\1" * (1 << 20))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / ".saving-x").mkdir()  # not ours: left alone

    def work():  # what the parent does with a table while someone truncates its data file
        with open(data, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        os.truncate(data, 0)
        return int(np.frombuffer(mapped, np.uint8).sum() > 0)

    code = guard.supervise(work, 60, str(scratch), str(tmp_path), "inspect")  # a real fork, a real SIGBUS
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "SIGBUS" in err and "nothing written" in err, err
    assert not scratch.exists() and (tmp_path / ".saving-x").exists()


# --- time and memory --------------------------------------------------------------------------------------------------

def test_onnxruntime_out_of_memory_is_a_finding(tmp_path):
    big, small = tmp_path / "big.onnx", tmp_path / "small.onnx"
    graphs.save(graphs.tied_logits(graphs.make_table(32768, 1024)), big)  # a 128 MiB table
    graphs.save(graphs.tied_logits(graphs.make_table(64, 8)), small)
    assert inspect_cli(small, "--memory-limit", "0.4")[0] == 0  # the limit leaves room for onnxruntime itself
    code, _, err = inspect_cli(big, "--memory-limit", "0.4")
    assert one_line_error(code, err, "onnxruntime ran out of memory", "0.4 GiB", "--memory-limit")


def test_a_child_started_ahead_of_its_job_runs_it_under_that_jobs_limits(tmp_path):
    big = tmp_path / "big.onnx"
    graphs.save(graphs.tied_logits(graphs.make_table(32768, 1024)), big)  # a 128 MiB table
    job = jobs.optimize(jobs.tool_model(str(big)), str(tmp_path / "o.onnx"), str(tmp_path))
    ahead = isolated.prestart(str(tmp_path))
    assert isolated.prestart(str(tmp_path)) is ahead  # one ahead at most
    try:
        time.sleep(1)  # it has imported onnxruntime and waits, under no memory limit of its own yet
        step = isolated.start(job, "optimizing", isolated.Limits(60, memory=int(0.4 * isolated.GiB)), 0)
        assert step.child is ahead
        with pytest.raises(InspectError, match="ran out of memory.*0.4 GiB"):
            step.result()
    finally:
        isolated.let_go_ahead()
    assert isolated.call(job, "optimizing", isolated.Limits(60), big.stat().st_size).data is True  # room: runs
    ahead = isolated.prestart(str(tmp_path))
    isolated.let_go_ahead()  # no step took it: ended, and the next step starts its own
    step = isolated.start(job, "optimizing", isolated.Limits(60), 0)
    step.stop()
    assert ahead.returncode is not None and step.child is not ahead


def test_onnxruntime_time_out_is_a_finding(tmp_path):
    path = tmp_path / "m.onnx"
    graphs.save(graphs.tied_logits(graphs.make_table(64, 8)), path)
    start = time.monotonic()
    code, _, err = inspect_cli(path, "--timeout", "0.05")
    assert one_line_error(code, err, "did not finish", "--timeout 0.05 s")
    assert time.monotonic() - start < 10


def test_a_timeout_that_passes_before_the_work_starts_is_one_line(tmp_path):
    code, _, err = inspect_cli(os.path.join(FIXTURES, "torchscript_tied.onnx"), "--timeout", "1e-7")
    assert one_line_error(code, err, "did not finish within --timeout 1e-07 s")


def test_the_timeout_bounds_the_parents_own_work(tmp_path):
    path = tmp_path / "many.onnx"
    onnx.save(many_tables(1000), path)  # about 11 s of the parent's own relating, no onnxruntime in it
    start = time.monotonic()
    code, _, err = inspect_cli(path, "--timeout", "2")
    assert one_line_error(code, err, "did not finish", "--timeout 2 s", "nothing written")
    assert time.monotonic() - start < 2 + guard.GRACE


def test_the_deadline_stops_once_the_outputs_are_placed(tmp_path, capfd):  # fd level: the worker says it
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def placed_then_slow():  # OUT is in place; the lines and sidecars after it take past the deadline
        guard.committing()
        time.sleep(1.5)
        return 0

    assert guard.supervise(placed_then_slow, 1.0, str(scratch), None, "inspect") == 0
    assert guard.supervise(lambda: time.sleep(1.5) or 0, 1.0, str(tmp_path / "s2"), None, "inspect") == 2
    assert "did not finish within --timeout 1 s" in capfd.readouterr().err


def test_inherited_hard_limits_are_kept_not_a_traceback(tmp_path):
    path = tied(tmp_path / "m.onnx")
    gib = 2**30

    def shell_limits():  # as `ulimit -v 3G -f 1G` in the user's shell: hard limits this process cannot raise
        resource.setrlimit(resource.RLIMIT_AS, (3 * gib, 3 * gib))
        resource.setrlimit(resource.RLIMIT_FSIZE, (gib, gib))

    done = run_inspect(path, preexec_fn=shell_limits)
    assert done.returncode == 0 and "vocabulary: table embedding 64 x 8" in done.stdout, done.stderr


def test_the_parent_out_of_memory_under_a_shell_limit_is_one_line(tmp_path):
    path = tmp_path / "big.onnx"  # 256 MiB inline: parsing it takes more than the limit leaves
    onnx.save(transposed_head(np.ones((1 << 20, 64), np.float32)), path)
    limit = 700 * 2**20

    def shell_limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    code, _, err = inspect_cli(path, preexec_fn=shell_limit)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err


# --- signals and crashes ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_signal_leaves_nothing_behind(tmp_path, sig, code, word):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "retied.onnx"
    process = subprocess.Popen([sys.executable, "-m", "runtime.inspect",
                                os.path.join(FIXTURES, "genai_fp32", "model.onnx"), "--retie", str(out)], cwd=ROOT,
                               env=dict(os.environ, TMPDIR=str(scratch)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))  # a background job (CI)
                               # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    deadline = time.monotonic() + 60
    staged = lambda: [n for n in os.listdir(tmp_path) if n.startswith(".saving-")]
    while not (staged() and _children(scratch)) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # OUT staged beside its name and a child at work on it (the proof): the run is mid-way
    assert process.poll() is None, "the run ended before it could be signalled"
    process.send_signal(sig)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == code and word in err and "Traceback" not in err, err
    # onnxruntime itself leaves files there on any run (1.32: .ses, a session id; 1.30: mat-debug-PID.log): what
    # must go is the tool's own scratch folder
    assert not [n for n in os.listdir(scratch) if n.startswith(("onnx-lab-", "tmp"))] and not out.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".saving-")]
    assert _children(scratch) == ""  # no isolated child outlives the tool


def _children(scratch):
    """The processes whose command line names a folder in `scratch` (the tool's isolated children), as pgrep says."""
    return subprocess.run(["pgrep", "-f", str(scratch)], capture_output=True, text=True).stdout


def test_a_signal_while_a_folder_is_proven_in_its_staged_out_leaves_nothing(tmp_path):
    # a folder's OUT is written first, beside its name, and proven there: a signal then takes all of it back
    out = tmp_path / "retied"
    process = subprocess.Popen([sys.executable, "-m", "runtime.inspect", os.path.join(FIXTURES, "genai_fp32"),
                                "--retie", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not [n for n in os.listdir(tmp_path) if n.startswith(".saving-")] and time.monotonic() < deadline:
        time.sleep(0.02)
    staged = [n for n in os.listdir(tmp_path) if n.startswith(".saving-")]
    process.send_signal(signal.SIGTERM)
    err = process.communicate(timeout=120)[1]
    assert staged, "OUT was never staged beside its name"
    assert process.returncode == 143 and "terminated" in err and "Traceback" not in err, err
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".saving-")]


def test_a_hang_up_leaves_nothing_behind(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "runtime.inspect",
                                os.path.join(FIXTURES, "genai_fp32", "model.onnx")], cwd=ROOT,
                               env=dict(os.environ, TMPDIR=str(scratch)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP,
                                                                                                   signal.SIG_DFL))
    under_way(scratch)  # a fixed half second's sleep let the one-child inspect finish first, exit 0
    process.send_signal(signal.SIGHUP)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == 129 and "SIGHUP" in err and err.count("\n") == 1, err
    assert os.listdir(scratch) == []


def under_way(scratch, most=60):
    """Wait until inspect's first onnxruntime child has its job: the work is under way, that child's answer still to
    come (a fixed second's sleep once let the leaner inspect finish first, exit 0)."""
    deadline = time.monotonic() + most
    while not glob.glob(os.path.join(scratch, "*", "*job.json")) and time.monotonic() < deadline:  # a folder may go
        time.sleep(0.01)


def start(args, tmp_path, **kwargs):
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    return scratch, subprocess.Popen([sys.executable, "-m", "runtime.inspect", *map(str, args)], cwd=ROOT,
                                     env=dict(os.environ, TMPDIR=str(scratch)), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, **kwargs)


def test_an_inherited_ignored_sigchld_does_not_hang_the_command(tmp_path):
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    began = time.monotonic()
    _, process = start([os.path.join(FIXTURES, "genai_fp32", "model.onnx"), "--retie", out, "--timeout", "120"],
                       tmp_path, preexec_fn=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN))
    err = process.communicate(timeout=300)[1]
    assert process.returncode == 0 and "Traceback" not in err, err
    assert time.monotonic() - began < 60 and out.exists()  # not the deadline plus grace


def test_two_quick_interrupts_leave_one_line_and_nothing_behind(tmp_path):
    model = os.path.join(FIXTURES, "genai_fp32", "model.onnx")
    for gap in (0.0, 0.01, 0.03, 0.05, 0.2):
        scratch, process = start([model], tmp_path, start_new_session=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        under_way(scratch)
        os.killpg(process.pid, signal.SIGINT)  # as `kill -INT -- -PGID` twice: the worker gets each twice
        time.sleep(gap)
        os.killpg(process.pid, signal.SIGINT)
        err = process.communicate(timeout=120)[1]
        assert process.returncode == 130 and err.count("\n") == 1 and "Traceback" not in err, (gap, err)
        assert os.listdir(scratch) == [], gap


@pytest.mark.parametrize("sig, group", [(signal.SIGQUIT, True), (signal.SIGUSR1, False), (signal.SIGALRM, False)])
def test_other_fatal_signals_are_one_line_and_leave_nothing(tmp_path, sig, group):
    # a --retie: the signal lands among its children (optimize, measure, prove, measure again), and OUT must not be
    # written either
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    scratch, process = start([os.path.join(FIXTURES, "genai_fp32", "model.onnx"), "--retie", out], tmp_path,
                             start_new_session=True, preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    # (a background job inherits SIGQUIT ignored, as SIGINT, and the command rightly leaves it so)
    under_way(scratch)
    (os.killpg if group else os.kill)(process.pid, sig)
    err = process.communicate(timeout=120)[1]
    assert process.returncode > 128 and err.count("\n") == 1 and "Traceback" not in err, err
    assert os.listdir(scratch) == [] and os.listdir(out.parent) == []


def test_a_worker_killed_while_placing_leaves_nothing_half_placed(tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "other.onnx.data").write_bytes(b"someone else's")
    (tmp_path / "scratch").mkdir()

    def placing_then_killed():  # what graphs.save and sidecars leave at the moment a SIGKILL lands
        staging = folder / f".saving-{os.getpid()}-x"
        staging.mkdir()
        (staging / "o.onnx.data").write_bytes(b"data")
        os.link(staging / "o.onnx.data", folder / "o.onnx.data")  # the data placed, the model not yet
        (folder / f".sidecar-{os.getpid()}-y").write_bytes(b"{}")
        os.kill(os.getpid(), signal.SIGKILL)

    code = guard.supervise(placing_then_killed, 60, str(tmp_path / "scratch"), str(folder), "inspect",
                           str(folder / "o.onnx"))
    assert code == 2 and "nothing written" in capsys.readouterr().err
    assert sorted(os.listdir(folder)) == ["other.onnx.data"]


def test_a_killed_command_takes_its_children_with_it(tmp_path):
    folder = tmp_path / "model"  # its path names the worker and the onnxruntime child in `ps`
    shutil.copytree(os.path.join(FIXTURES, "genai_fp32"), folder)
    process = subprocess.Popen([sys.executable, "-m", "runtime.inspect", str(folder / "model.onnx")], cwd=ROOT,
                               env=dict(os.environ, TMPDIR=str(tmp_path)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)

    def running():
        return subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()

    deadline = time.monotonic() + 60
    while len(running()) < 3 and time.monotonic() < deadline:  # the command, its worker, the onnxruntime child
        time.sleep(0.05)
    assert len(running()) >= 3
    process.kill()  # SIGKILL: nothing of the command runs any more, not even a handler
    process.wait()
    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running() == []


def test_onnxruntime_leaves_nothing_in_tmpdir(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = run_inspect(tied(tmp_path / "m.onnx"), env=dict(os.environ, TMPDIR=str(scratch)))
    assert done.returncode == 0, done.stderr
    assert os.listdir(scratch) == []  # onnxruntime's .ses and logs went to the scratch folder, removed with it


# --- the child's own module -------------------------------------------------------------------------------------------

def test_the_child_has_its_own_entry_module_and_the_package_imports_nothing():
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import runtime.inspect.sandbox.child"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "runtime.inspect.sandbox.child" in imported
    assert not imported & {"runtime.inspect.cli", "runtime.inspect.retie.write", "onnxruntime"}
    # the reader: neither onnxruntime nor the command line (the package's face is lazy)
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import runtime.model.read.model"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "runtime.model.read.model" in imported
    assert not imported & {"runtime.inspect.cli", "runtime.inspect.sandbox.isolated", "onnxruntime"}
    done = subprocess.run([sys.executable, "-W", "error", "-m", "runtime.inspect.sandbox.child", "/nonexistent/job.json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "RuntimeWarning" not in done.stderr and "FileNotFoundError" in done.stderr


# --- feeds ------------------------------------------------------------------------------------------------------------

def test_a_sliding_window_sets_the_proofs_past():
    model = onnx.load(os.path.join(FIXTURES, "genai_gemma2_fp32", "model.onnx"), load_external_data=False)
    shape = feeds.plan(model, os.path.join(FIXTURES, "genai_gemma2_fp32", "model.onnx"))
    window = MADE["genai_gemma2_fp32"]["config"]["sliding_window"]
    assert shape["past"] == window and shape["head_size"] == 16 and "window" in shape["why"]
    entry = token_entry(findings(model_in("genai_gemma2_fp32")))
    assert entry["in_memory"]["defaults"]["resident_bytes"] is not None  # the model ran on those feeds


def test_genai_fp16_gets_several_new_tokens_only_as_a_prompt():
    # onnxruntime-genai's builder masks several new tokens with a [seq, seq] causal mask expanded to [seq, past +
    # seq] (attn_mask_reformat): only a prompt, at past 0, as genai feeds it; one new token after any past
    import onnxruntime as ort
    path = os.path.join(FIXTURES, "genai_fp16", "model.onnx")
    model = onnx.load(path, load_external_data=False)
    shape = feeds.plan(model, path)
    assert shape["steps"] == [[0, 3], [4, 1], [0, 1], [3, 1]]
    assert feeds.describe(shape) == "3 new tokens after past 0; 1 after past 4 (the default), 0 and 3"
    session = ort.InferenceSession(path)
    for past, sequence in shape["steps"]:
        (logits,) = session.run(["logits"], feeds.shaped_feeds(model, {"input_ids": 512}, shape, sequence, past=past))
        assert logits.shape == (1, sequence, 512)
    with pytest.raises(Exception, match="invalid expand shape"):  # the feeds the plan no longer makes
        session.run(["logits"], feeds.shaped_feeds(model, {"input_ids": 512}, shape, 3, past=4))


def test_plan_reads_windows_and_context_from_the_files_beside(tmp_path):
    graph = helper.make_graph([helper.make_node("GroupQueryAttention", ["q"], ["y"], domain="com.microsoft",
                                                local_window_size=48, num_heads=2, kv_num_heads=1)], "g",
                              [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 1, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 32])])
    model = helper.make_model(graph)
    path = tmp_path / "model.onnx"
    assert feeds.plan(model, path)["past"] == 48
    (tmp_path / "config.json").write_text(json.dumps({"sliding_window": 60, "max_position_embeddings": 62}))
    shape = feeds.plan(model, path)
    assert (shape["past"], shape["lengths"]) == (60, [1])  # 60 + 3 would pass the model's 62 positions
    assert feeds.plan(model, path, past=7)["past"] == 7
