"""What a reviewer's first hour as an attacker found on 2026-12-01, one test each: every answer is a report or one
line and a documented status, nothing left behind, nothing read from outside the model's folder."""
import glob
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
from onnx import TensorProto, helper, numpy_helper

import graphs
from runtime.inspect.graph import constants
from runtime.inspect.read import checked as read_checked
from runtime.inspect.read.model import load
from runtime.inspect.sandbox import guard
from tests.helpers import FIXTURES, ROOT, head_through, inspect_cli, model_of, one_line_error


def genai_copy(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(os.path.join(FIXTURES, "genai_fp32"), folder)
    return folder


def transposed_head(table=None):
    """A head reading its table through a Transpose: --retie has something to rewrite."""
    return head_through([helper.make_node("Transpose", ["embedding"], ["t"], perm=[1, 0])], table)


def run(args, **kwargs):
    done = subprocess.run([sys.executable, "-m", "runtime.inspect", *map(str, args)], cwd=kwargs.pop("cwd", ROOT),
                          capture_output=True, text=True, timeout=300, **kwargs)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("name", ["config.json", "genai_config.json"])
def test_a_sidecar_nested_past_the_parsers_depth_is_ignored(tmp_path, name):
    folder = genai_copy(tmp_path)
    (folder / name).write_text("[" * 200000 + "]" * 200000)
    code, out, err = inspect_cli(folder / "model.onnx")
    assert code == 0 and "vocabulary:" in out and "Traceback" not in err, err


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


def test_a_timeout_that_passes_before_the_work_starts_is_one_line(tmp_path):
    code, _, err = inspect_cli(os.path.join(FIXTURES, "torchscript_tied.onnx"), "--timeout", "1e-7")
    assert one_line_error(code, err, "did not finish within --timeout 1e-07 s")


def test_the_parent_out_of_memory_under_a_shell_limit_is_one_line(tmp_path):
    path = tmp_path / "big.onnx"  # 256 MiB inline: parsing it takes more than the limit leaves
    onnx.save(transposed_head(np.ones((1 << 20, 64), np.float32)), path)
    limit = 700 * 2**20

    def shell_limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    code, _, err = run([path], preexec_fn=shell_limit)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err


def constant_shape_model(folder):
    """GatherBlockQuantized rows reshaped by a Constant whose value is external data (c.bin beside the model)."""
    np.array([1, 32], np.int64).tofile(folder / "c.bin")
    shape = TensorProto(name="shape_c", data_type=TensorProto.INT64, dims=[2], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "c.bin"), ("offset", "0"), ("length", "16")):
        entry = shape.external_data.add()
        entry.key, entry.value = key, value
    nodes = [helper.make_node("GatherBlockQuantized", ["table", "ids", "scales"], ["rows"], domain="com.microsoft",
                              block_size=32, bits=4),
             helper.make_node("Constant", [], ["shp"], value=shape), helper.make_node("Reshape", ["rows", "shp"], ["out"])]
    model = model_of(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                     [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                     [numpy_helper.from_array(np.zeros((16, 16), np.uint8), "table"),
                      numpy_helper.from_array(np.ones((16, 1), np.float32), "scales")])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, folder / "model.onnx")
    return folder / "model.onnx"


def test_a_constant_with_external_data_is_never_read_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "elsewhere").mkdir()
    path = constant_shape_model(tmp_path / "model")
    np.array([4, 8], np.int64).tofile(tmp_path / "elsewhere" / "c.bin")  # what a path resolved here would read
    monkeypatch.chdir(tmp_path / "elsewhere")
    model = load(path)
    producer = {out: node for node in model.proto.graph.node for out in node.output}
    assert constants.constant("shp", producer, model) is None  # not read at all: onnx would resolve it here
    code, _, err = run([path], cwd=tmp_path)  # a folder with no c.bin: once a traceback
    assert code in (0, 2) and "Traceback" not in err, err


@pytest.mark.parametrize("dims", [(0, 8), (64, 0), (0, 0)])
def test_an_empty_table_is_reported_not_a_traceback(tmp_path, dims):
    table = np.zeros(dims, np.float32)
    path = tmp_path / "empty.onnx"
    model = model_of([helper.make_node("Gather", ["embedding", "ids"], ["e"]),
                      helper.make_node("Transpose", ["embedding"], ["t"], perm=[1, 0]),
                      helper.make_node("MatMul", ["hidden", "t"], ["logits"])],
                     [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                      helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", dims[1]])],
                     [helper.make_tensor_value_info("e", TensorProto.FLOAT, None),
                      helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                     [numpy_helper.from_array(table, "embedding")])
    onnx.save(model, path)
    code, out, err = inspect_cli(path)
    assert code == 0 and "vocabulary: no table" in out and "Traceback" not in err, err


def test_paths_that_are_not_utf8_are_refused_in_one_line(tmp_path):
    model = os.path.join(FIXTURES, "torchscript_tied.onnx")
    bad = os.fsdecode(bytes(tmp_path) + b"/o\xff.onnx")
    code, _, err = run([model, "--retie", bad])
    assert one_line_error(code, err, "OUT", "not UTF-8")
    done = subprocess.run([sys.executable, "-m", "graphs.export", os.fsdecode(bytes(tmp_path) + b"/d\xff")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert one_line_error(done.returncode, done.stderr, "DIR", "not UTF-8") and os.listdir(tmp_path) == []


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


def test_a_sidecar_that_cannot_be_written_leaves_out_whole(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(os.path.join(FIXTURES, "torchscript_tied.onnx"), folder / "model.onnx")
    (folder / "tokenizer.json").write_bytes(b"{" + b" " * (10 << 20) + b"}")  # 10 MiB: past the file-size limit
    limit = 5 << 20

    def shell_limit():  # `ulimit -f` in the user's shell: OUT (40 KB) fits, the tokenizer does not
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    code, stdout, err = run([folder / "model.onnx", "--retie", out], preexec_fn=shell_limit)
    assert code == 0 and "tokenizer.json not copied beside OUT: File too large" in stdout, (stdout, err)
    onnx.checker.check_model(str(out))
    assert sorted(os.listdir(out.parent)) == ["model.onnx"]


def test_inputs_that_cannot_be_fed_mean_it_cannot_be_proven_here(tmp_path):
    model = transposed_head()
    model.graph.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, []))  # a scalar
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    code, _, err = inspect_cli(path, "--retie", tmp_path / "out.onnx")
    assert one_line_error(code, err, "cannot be proven on this machine", "no feeds can be made")
    assert not (tmp_path / "out.onnx").exists()


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


def test_a_hang_up_leaves_nothing_behind(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "runtime.inspect",
                                os.path.join(FIXTURES, "genai_fp32", "model.onnx")], cwd=ROOT,
                               env=dict(os.environ, TMPDIR=str(scratch)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP,
                                                                                                   signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not os.listdir(scratch) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    process.send_signal(signal.SIGHUP)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == 129 and "SIGHUP" in err and err.count("\n") == 1, err
    assert os.listdir(scratch) == []


def test_control_characters_in_arguments_are_escaped(tmp_path):
    model = os.path.join(FIXTURES, "torchscript_tied.onnx")
    code, _, err = run([model, "--bogus\x1b[2J"])
    assert one_line_error(code, err, "\\x1b[2J") and "\x1b" not in err


def test_compare_takes_a_negative_seed_as_the_table_does():
    done = subprocess.run([sys.executable, "-m", "runtime.compare", "--seed", "-1", "--vocab-size", "64", "--width",
                           "8", "--format", "int4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


# --- the second round -------------------------------------------------------------------------------

def under_way(scratch, most=60):
    """Wait until inspect's first onnxruntime child has its job: the work is under way, two more children to come
    (a fixed second's sleep once let the leaner inspect finish first, exit 0)."""
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
    scratch, process = start([os.path.join(FIXTURES, "genai_fp32", "model.onnx")], tmp_path, start_new_session=True)
    under_way(scratch)
    (os.killpg if group else os.kill)(process.pid, sig)
    err = process.communicate(timeout=120)[1]
    assert process.returncode > 128 and err.count("\n") == 1 and "Traceback" not in err, err
    assert os.listdir(scratch) == []


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


def test_a_name_that_is_not_utf8_inside_a_subgraph_is_refused(tmp_path):
    branch = helper.make_graph([helper.make_node("Identity", ["embedding"], ["b"], name="NAMEMARK")], "then", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    model = transposed_head()
    model.graph.input.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    model.graph.node.append(helper.make_node("If", ["flag"], ["picked"], then_branch=branch, else_branch=branch))
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString().replace(b"NAMEMARK", b"\xff\xfe\x1b[2J\x07\xfc"))  # same length
    code, _, err = inspect_cli(path)
    assert one_line_error(code, err, "not valid UTF-8") and "\x1b" not in err


def test_a_device_where_a_sidecar_is_looked_for_is_not_opened(tmp_path):
    folder = genai_copy(tmp_path)
    try:
        os.mknod(folder / "config.json", 0o600 | 0o020000, os.makedev(1, 3))  # a character device (/dev/null's)
    except (PermissionError, OSError):
        pytest.skip("cannot make a device node here")
    code, out, err = inspect_cli(folder / "model.onnx")
    assert code == 0 and "vocabulary:" in out, err
