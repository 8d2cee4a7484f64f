"""The lab_env/python wrapper, exercised in temporary locations with a tiny hand-made wheel (no registry)."""
import base64
import fcntl
import hashlib
import os
import shutil
import subprocess
import zipfile

import pytest

from tests.helpers import ROOT

LAB_ENV = os.path.join(ROOT, "lab_env")


def make_wheel(folder, version, package="labprobe"):
    """A minimal pure-Python wheel of the package `package` whose VERSION is `version`."""
    name = f"{package}-{version}.dist-info"
    files = {
        f"{package}.py": f"VERSION = {version!r}\n",
        f"{name}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n",
        f"{name}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{name}/RECORD"] = "\n".join(record + [f"{name}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / f"{package}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.fixture
def repo(tmp_path):
    """A copy of lab_env/ in a fresh repo, pinned to labprobe from a local wheel folder."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version in ("1.0", "2.0"):
        make_wheel(wheels, version)
    make_wheel(wheels, "1.0", "labtool")  # a test tool
    root = tmp_path / "repo"
    (root / "lab_env").mkdir(parents=True)
    for name in ("python", "build.py"):
        shutil.copy2(os.path.join(LAB_ENV, name), root / "lab_env" / name)
    (root / "rootmodule.py").write_text("WHERE = 'repo root'\n")
    pin(root, "1.0", wheels)
    (root / "lab_env" / "requirements-test.txt").write_text(f"--no-index\n--find-links {wheels}\nlabtool==1.0\n")
    return root


def pin(root, version, wheels=None):
    wheels = wheels or root.parent / "wheels"
    (root / "lab_env" / "requirements.txt").write_text(
        f"--no-index\n--find-links {wheels}\nlabprobe=={version}\n")


def call(root, lab, *args, stdin="", path=None):
    env = dict(os.environ, ONNX_LAB=str(lab))
    if path is not None:
        env["PATH"] = path
    return subprocess.run([str(root / "lab_env" / "python"), *args], input=stdin,
                          capture_output=True, text=True, env=env, timeout=300)


def one_error_line(stderr):
    """The error, after at most one progress line, every line ours, no traceback."""
    lines = stderr.splitlines()
    assert 1 <= len(lines) <= 2 and all(line.startswith("lab_env/python: ") for line in lines), stderr
    return lines[-1]


VERSION = ["-c", "import labprobe; print(labprobe.VERSION)"]


@pytest.mark.slow
def test_lab_env_first_run_creates_second_installs_nothing(repo, tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()  # an empty folder is a fine place for it
    first = call(repo, lab, *VERSION)
    assert (first.returncode, first.stdout) == (0, "1.0\n")
    assert "building" in first.stderr
    assert (lab / ".lab-requirements.txt").read_bytes() == (repo / "lab_env" / "requirements.txt").read_bytes()
    assert "labprobe==1.0" in (lab / ".lab-freeze.txt").read_text()
    log_mtime = (lab / ".lab-install.log").stat().st_mtime_ns

    second = call(repo, lab, *VERSION)
    assert (second.returncode, second.stdout, second.stderr) == (0, "1.0\n", "")
    assert (lab / ".lab-install.log").stat().st_mtime_ns == log_mtime  # pip never ran


@pytest.mark.slow
def test_lab_env_installs_the_test_tools_for_a_test_run_only(repo, tmp_path):
    lab = tmp_path / "lab"
    tool = ["-c", "import labtool"]
    assert call(repo, lab, *VERSION).stdout == "1.0\n"
    assert call(repo, lab, *tool).returncode != 0  # the main job's environment holds no test tool
    assert not (lab / ".lab-test-requirements.txt").read_bytes()
    tests = call(repo, lab, "-m", "pytest", "--version")  # no pytest in this tiny repo's pins: it fails after
    assert "adding the test tools" in tests.stderr and "No module named pytest" in tests.stderr
    assert call(repo, lab, *tool).returncode == 0
    again = call(repo, lab, "-m", "pytest", "--version")
    assert "adding" not in again.stderr and "updating" not in again.stderr  # nothing installed twice
    assert (lab / ".lab-test-requirements.txt").read_bytes() == (repo / "lab_env" / "requirements-test.txt").read_bytes()


@pytest.mark.slow
def test_lab_env_changed_requirement_updates_failed_update_keeps_previous(repo, tmp_path):
    lab = tmp_path / "lab"
    assert call(repo, lab, *VERSION).stdout == "1.0\n"
    pin(repo, "2.0")
    updated = call(repo, lab, *VERSION)
    assert (updated.returncode, updated.stdout) == (0, "2.0\n")
    assert "updating" in updated.stderr

    pin(repo, "9.9")  # no such wheel: pip fails before touching anything
    failed = call(repo, lab, *VERSION)
    assert failed.returncode != 0 and failed.stdout == ""
    assert one_error_line(failed.stderr).startswith("lab_env/python: installing the pinned requirements failed")
    assert "previous environment is unchanged" in failed.stderr
    still = subprocess.run([str(lab / "bin" / "python"), *VERSION], capture_output=True, text=True)
    assert still.stdout == "2.0\n"
    assert "labprobe==2.0" in (lab / ".lab-requirements.txt").read_text()


@pytest.mark.slow
def test_lab_env_half_built_never_looks_complete(repo, tmp_path):
    lab = tmp_path / "lab"
    pin(repo, "9.9")
    failed = call(repo, lab, *VERSION)
    assert failed.returncode != 0 and "nothing was marked installed" in one_error_line(failed.stderr)
    assert not (lab / ".lab-requirements.txt").exists()
    pin(repo, "1.0")
    assert call(repo, lab, *VERSION).stdout == "1.0\n"  # the next call finishes the job


@pytest.mark.slow
def test_lab_env_two_first_runs_at_once(repo, tmp_path):
    lab = tmp_path / "lab"
    env = dict(os.environ, ONNX_LAB=str(lab))
    procs = [subprocess.Popen([str(repo / "lab_env" / "python"), *VERSION], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    assert [(out, rc) for out, _, rc in results] == [("1.0\n", 0), ("1.0\n", 0)], results
    assert sum("building" in err for _, err, _ in results) == 1  # one built, the other waited


@pytest.mark.slow
def test_lab_env_waits_for_a_build_in_progress_before_judging_the_folder(repo, tmp_path):
    # A build in progress holds the lock and has made bin/ but not yet pyvenv.cfg: a second first run
    # must wait for it, not call the half-made folder foreign.
    lab = tmp_path / "lab"
    (lab / "bin").mkdir(parents=True)
    with open(lab / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = dict(os.environ, ONNX_LAB=str(lab))
        waiting = subprocess.Popen([str(repo / "lab_env" / "python"), *VERSION], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=3)  # blocked on the lock, not refused
        (lab / "bin").rmdir()  # the other build failed and cleaned up; the lock goes with the block
    out, err = waiting.communicate(timeout=300)
    assert (out, waiting.returncode) == ("1.0\n", 0), err


@pytest.mark.slow
def test_lab_env_passes_arguments_stdin_and_exit_status(repo, tmp_path):
    lab = tmp_path / "lab"
    script = ("import sys, rootmodule; print(sys.argv[1:], rootmodule.WHERE, sys.stdin.read());"
              "sys.exit(int(sys.argv[1]))")
    done = call(repo, lab, "-c", script, "7", "two words", "--flag", stdin="from stdin")
    assert done.returncode == 7
    assert done.stdout == "['7', 'two words', '--flag'] repo root from stdin\n"


def test_lab_env_unwritable_location_fails_cleanly(repo, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = call(repo, blocker / "lab", *VERSION)  # a folder inside a file cannot be made, even by root
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and "set ONNX_LAB" in done.stderr and "Traceback" not in done.stderr


def test_lab_env_refuses_a_folder_with_other_files(repo, tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "notes.txt").write_text("mine")
    done = call(repo, lab, *VERSION)
    assert done.returncode != 0 and done.stderr.count("\n") == 1 and "ONNX_LAB" in done.stderr
    assert sorted(os.listdir(lab)) == ["notes.txt"]  # nothing of the user's touched, nothing added


def test_lab_env_without_python3_says_so(repo, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    done = call(repo, tmp_path / "lab", *VERSION, path=str(empty))
    assert done.returncode == 127
    assert done.stderr.count("\n") == 1 and "python3 not found" in done.stderr
