"""Create or update the pinned lab environment; lab_env/python calls this only when the pins changed.

Usage: python3 build.py LAB_DIR REQUIREMENTS

Safe when several first runs start at once (an flock on LAB_DIR/.lock); the record of what was
installed (LAB_DIR/.lab-requirements.txt) is written last and atomically, so a half-built
environment never looks complete and a failed update leaves the previous one as it was.
"""
import fcntl
import os
import subprocess
import sys

STAMP = ".lab-requirements.txt"  # a copy of the requirements that were installed
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
    ours = {".lock", STAMP, FREEZE, LOG}
    entries = set(os.listdir(lab)) - ours
    if entries and "pyvenv.cfg" not in entries:
        raise BuildError(f"{lab} holds files that are not a Python environment; "
                         "set ONNX_LAB to an empty or new folder")


def _run(cmd, log):
    with open(log, "ab") as out:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT).returncode


def build(lab, requirements):
    lab = os.path.abspath(lab)
    _prepare(lab)
    wanted = _read(requirements)
    if wanted is None:
        raise BuildError(f"{requirements} is missing")
    if ".lock" not in os.listdir(lab):
        _check_ours(lab)  # a folder that is not ours is refused before a lock file is added to it
    with open(os.path.join(lab, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second first run waits here, then finds the work done
        _check_ours(lab)
        python = os.path.join(lab, "bin", "python")
        if os.access(python, os.X_OK) and _read(os.path.join(lab, STAMP)) == wanted:
            return
        log = os.path.join(lab, LOG)
        _write_atomic(log, b"")
        fresh = not os.access(python, os.X_OK)
        print(f"lab_env/python: {'building' if fresh else 'updating'} the lab environment in {lab} "
              "(once; later calls start at once)", file=sys.stderr)
        if fresh:
            if subprocess.run([sys.executable, "-c", "import venv, ensurepip"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode:
                raise BuildError(f"{sys.executable} cannot create virtual environments; "
                                 "install its venv module (Debian: apt-get install python3-venv)")
            if _run([sys.executable, "-m", "venv", lab], log):
                raise BuildError(f"creating the environment in {lab} failed; see {log}")
        # --no-deps: requirements.txt pins every dependency itself (tokenizers' huggingface-hub stays out)
        pip = [python, "-m", "pip", "--disable-pip-version-check", "install", "--no-deps", "-r", requirements]
        if _run(pip, log):
            before = "the previous environment is unchanged" if not fresh else "nothing was marked installed"
            raise BuildError(f"installing the pinned requirements failed (is the package registry "
                             f"reachable?); {before}; see {log}")
        freeze = subprocess.run([python, "-m", "pip", "freeze", "--all"], capture_output=True)
        _write_atomic(os.path.join(lab, FREEZE), freeze.stdout)
        _write_atomic(os.path.join(lab, STAMP), wanted)  # last: from now on the environment is complete


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: build.py LAB_DIR REQUIREMENTS", file=sys.stderr)
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
