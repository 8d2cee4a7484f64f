"""Create or update the pinned lab environment; lab_env/python calls this only when the pins changed.

Usage: python3 build.py LAB_DIR REQUIREMENTS [TEST_REQUIREMENTS]

REQUIREMENTS are what the main job needs; TEST_REQUIREMENTS (the test tools, asked for by `lab_env/python -m
pytest`) are installed after them into the same environment, each file recorded by a stamp of its own.

Safe when several first runs start at once (an flock on LAB_DIR/.lock); the record of what was
installed (LAB_DIR/.lab-requirements.txt) is written last and atomically, so a half-built
environment never looks complete and a failed update leaves the previous one as it was.
"""
import fcntl
import os
import subprocess
import sys

STAMP = ".lab-requirements.txt"  # a copy of the requirements that were installed
TEST_STAMP = ".lab-test-requirements.txt"  # and of the test tools, once a test run asked for them
FREEZE = ".lab-freeze.txt"  # what pip reports as installed
LOG = ".lab-install.log"


class BuildError(Exception):
    pass


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _write_atomic(path, data):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _prepare(lab):
    """Make LAB_DIR exist and be writable."""
    try:
        os.makedirs(lab, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create {lab} ({e.strerror}); set ONNX_LAB to a writable folder") from None
    if not os.access(lab, os.W_OK | os.X_OK):
        raise BuildError(f"cannot write to {lab}; set ONNX_LAB to a writable folder")


def _check_ours(lab):
    """LAB_DIR must be empty or an environment already. A build in progress elsewhere shows its folders
    before venv writes pyvenv.cfg, so where its .lock exists this is asked again under the lock."""
    ours = {".lock", STAMP, TEST_STAMP, FREEZE, LOG}
    entries = set(os.listdir(lab)) - ours
    if entries and "pyvenv.cfg" not in entries:
        raise BuildError(f"{lab} holds files that are not a Python environment; "
                         "set ONNX_LAB to an empty or new folder")


def _run(cmd, log):
    with open(log, "ab") as out:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT).returncode


def build(lab, requirements, tests=None):
    """Make LAB_DIR hold `requirements` (and `tests`, the test tools, when given), each installed once."""
    lab = os.path.abspath(lab)
    _prepare(lab)
    wanted = [(path, _read(path), stamp) for path, stamp in ((requirements, STAMP), (tests, TEST_STAMP)) if path]
    missing = [path for path, data, _ in wanted if data is None]
    if missing:
        raise BuildError(f"{missing[0]} is missing")
    if ".lock" not in os.listdir(lab):
        _check_ours(lab)  # a folder that is not ours is refused before a lock file is added to it
    with open(os.path.join(lab, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second first run waits here, then finds the work done
        _check_ours(lab)
        python = os.path.join(lab, "bin", "python")
        if not os.access(python, os.X_OK):
            _write_atomic(os.path.join(lab, TEST_STAMP), b"")  # a new environment holds no test tools yet
        todo = [(path, data, stamp) for path, data, stamp in wanted
                if not os.access(python, os.X_OK) or _read(os.path.join(lab, stamp)) != data]
        if todo:
            _install(lab, python, todo)


def _install(lab, python, todo):
    """Create the venv if need be and pip install each (path, data, stamp) of `todo`, its stamp written last."""
    log = os.path.join(lab, LOG)
    _write_atomic(log, b"")
    fresh = not os.access(python, os.X_OK)
    what = "the lab environment" if todo[0][2] == STAMP else "the test tools into the lab environment"
    print(f"lab_env/python: {'building' if fresh else 'updating' if todo[0][2] == STAMP else 'adding'} {what} in "
          f"{lab} (once; later calls start at once)", file=sys.stderr)
    if fresh:
        if subprocess.run([sys.executable, "-c", "import venv, ensurepip"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode:
            raise BuildError(f"{sys.executable} cannot create virtual environments; "
                             "install its venv module (Debian: apt-get install python3-venv)")
        if _run([sys.executable, "-m", "venv", lab], log):
            raise BuildError(f"creating the environment in {lab} failed; see {log}")
    for path, data, stamp in todo:
        # --no-deps: each file pins every dependency itself (tokenizers' huggingface-hub stays out)
        pip = [python, "-m", "pip", "--disable-pip-version-check", "install", "--no-deps", "-r", path]
        if _run(pip, log):
            before = "the previous environment is unchanged" if not fresh else "nothing was marked installed"
            raise BuildError(f"installing the pinned requirements failed (is the package registry "
                             f"reachable?); {before}; see {log}")
        freeze = subprocess.run([python, "-m", "pip", "freeze", "--all"], capture_output=True)
        _write_atomic(os.path.join(lab, FREEZE), freeze.stdout)
        _write_atomic(os.path.join(lab, stamp), data)  # last: from now on this part is complete
        fresh = False


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: build.py LAB_DIR REQUIREMENTS [TEST_REQUIREMENTS]", file=sys.stderr)
        return 2
    try:
        build(*args)
    except BuildError as e:
        print(f"lab_env/python: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"lab_env/python: {e.filename or ''}: {e.strerror}; set ONNX_LAB to a writable folder", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
