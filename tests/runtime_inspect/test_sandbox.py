"""runtime.inspect on hostile input, round two, the parent's side: what the child loads is what the parent checked,
a file truncated while mapped, the whole command under --timeout, limits the user's shell set, and a killed
command taking its children with it. Every answer is a report or one line, and nothing is left behind."""
import mmap
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from runtime.inspect.read import checked as read_checked
from runtime.inspect.read.model import load
from runtime.inspect.read.text import InspectError
from runtime.inspect.sandbox import guard, isolated
from tests.helpers import FIXTURES, ROOT, head_through, inspect_cli, many_tables, model_of, one_line_error


def tied(path, vocab=64, width=8, seed=0, external=False):
    graphs.save(graphs.tied_logits(graphs.make_table(vocab, width, seed)), path, external=external)
    return path


def test_a_model_swapped_after_the_check_is_never_run(tmp_path):
    path = tied(tmp_path / "m.onnx")
    model = load(path)
    tied(tmp_path / "other.onnx", seed=1)
    os.replace(tmp_path / "other.onnx", path)  # swapped between the parent's check and the child's load
    job = {"kind": "optimize", "checked": model.checked, "out": str(tmp_path / "opt.onnx"), "folder": str(tmp_path)}
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
    assert read_checked.source(model.checked)[0] == open(path, "rb").read()  # unchanged: the checked bytes


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


def test_the_timeout_bounds_the_parents_own_work(tmp_path):
    path = tmp_path / "many.onnx"
    onnx.save(many_tables(1000), path)  # about 11 s of the parent's own relating, no onnxruntime in it
    start = time.monotonic()
    code, _, err = inspect_cli(path, "--timeout", "2")
    assert one_line_error(code, err, "did not finish", "--timeout 2 s", "nothing written")
    assert time.monotonic() - start < 2 + guard.GRACE


def test_inherited_hard_limits_are_kept_not_a_traceback(tmp_path):
    path = tied(tmp_path / "m.onnx")
    gib = 2**30

    def shell_limits():  # as `ulimit -v 3G -f 1G` in the user's shell: hard limits this process cannot raise
        resource.setrlimit(resource.RLIMIT_AS, (3 * gib, 3 * gib))
        resource.setrlimit(resource.RLIMIT_FSIZE, (gib, gib))

    done = subprocess.run([sys.executable, "-m", "runtime.inspect", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, preexec_fn=shell_limits)
    assert done.returncode == 0 and "vocabulary: table embedding 64 x 8" in done.stdout, done.stderr


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
    done = subprocess.run([sys.executable, "-m", "runtime.inspect", str(tied(tmp_path / "m.onnx"))], cwd=ROOT,
                          env=dict(os.environ, TMPDIR=str(scratch)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert os.listdir(scratch) == []  # onnxruntime's .ses and logs went to the scratch folder, removed with it


def test_a_tiny_memory_limit_is_a_usage_error(tmp_path):
    code, _, err = inspect_cli(tied(tmp_path / "m.onnx"), "--memory-limit", "0.000001")
    assert one_line_error(code, err, "at least 0.25 GiB")


def test_a_fifo_or_folder_sidecar_does_not_block_retie(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(os.path.join(FIXTURES, "genai_fp32"), folder)
    os.remove(folder / "genai_config.json")
    os.mkfifo(folder / "genai_config.json")
    (folder / "generation_config.json").mkdir()  # a folder where a file is looked for: skipped, not an error
    start = time.monotonic()
    code, out, err = inspect_cli(folder / "model.onnx", "--retie", tmp_path / "out" / "model.onnx", timeout=300)
    assert code == 2 and "no such folder" in err  # OUT's folder is checked first
    (tmp_path / "out").mkdir()
    code, out, err = inspect_cli(folder / "model.onnx", "--retie", tmp_path / "out" / "model.onnx", timeout=300)
    assert code == 0 and "Traceback" not in err, err
    assert time.monotonic() - start < 240
    copied = os.listdir(tmp_path / "out")
    assert "genai_config.json" not in copied and "generation_config.json" not in copied  # not files to copy


def test_a_dense_data_file_whose_range_tensors_share_is_not_sparse(tmp_path):
    width = 1 << 16
    rows = (65 << 20) // (4 * width)  # past the 64 MiB from which holes are looked for
    table = np.ones((rows, width), np.float32)
    (tmp_path / "data.bin").write_bytes(table.tobytes())
    nodes, inits = [], []
    for name in ("a", "b", "c"):  # three tensors over one range of a dense file
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=table.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "data.bin"), ("offset", "0"), ("length", str(table.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        inits.append(tensor)
        nodes.append(helper.make_node("Gather", [name, "ids"], [f"e{name}"]))
    model = model_of(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                     [helper.make_tensor_value_info(f"e{n}", TensorProto.FLOAT, None) for n in "abc"], inits)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert sorted(load(path).tensors) == ["a", "b", "c"]  # read, not refused as sparse
    os.truncate(tmp_path / "data.bin", 0)
    os.truncate(tmp_path / "data.bin", table.nbytes)  # now it is a hole: refused
    with pytest.raises(InspectError, match="sparse"):
        load(path)


def test_two_reties_to_one_out_never_both_claim_it(tmp_path):
    tables = {name: graphs.make_table(16, 4, seed) for seed, name in enumerate("ab")}
    for name, table in tables.items():  # heads through a Transpose: --retie has something to write
        onnx.save(head_through([helper.make_node("Transpose", ["embedding"], ["t"], perm=[1, 0])], table),
                  tmp_path / f"{name}.onnx")
    for round_ in range(3):
        out = tmp_path / f"out{round_}.onnx"
        runs = {name: subprocess.Popen([sys.executable, "-m", "runtime.inspect", str(tmp_path / f"{name}.onnx"),
                                        "--retie", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True) for name in tables}
        answers = {name: (run.wait(timeout=300), *run.communicate()) for name, run in runs.items()}
        winners = [name for name, (code, stdout, _) in answers.items() if code == 0 and f"wrote {out}" in stdout]
        losers = [name for name, (code, _, err) in answers.items()
                  if code == 2 and ("exists" in err or "appeared" in err)]
        assert len(winners) == 1 and len(losers) == 1, answers
        table = numpy_helper.to_array(next(t for t in onnx.load(out).graph.initializer if t.name == "embedding"))
        assert table.tobytes() == tables[winners[0]].tobytes()  # OUT holds the winner's model, whole
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".saving-")]
