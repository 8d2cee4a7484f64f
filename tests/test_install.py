"""`pip install .` as README's install section says: into a throwaway venv, then the console commands of
pyproject.toml's [project.scripts] run from another folder, with none of this repository on the path, and name
themselves in usage and errors. The venv sees the lab environment's numpy, onnx and onnxruntime through a .pth
file, so nothing is downloaded but the build backend (when the lab's setuptools cannot build a wheel itself)."""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # every test here shares a throwaway venv with the project installed (~10 s to build)

SOURCES = ["pyproject.toml", "README.md", "embed.py", "graphs", "reference", "runtime"]  # what the build reads
COMMANDS = ["onnx-lab-inspect", "onnx-lab-compare", "onnx-lab-export"]
MODULES = ["embed", "reference", "graphs", "runtime"]  # the top-level modules the README says it installs
OFFLINE = ("No matching distribution found for setuptools", "Could not find a version that satisfies",
           "NewConnectionError", "Network is unreachable", "Temporary failure in name resolution")


def env():
    """The environment without the lab wrapper's PYTHONPATH (which names this repository)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def can_build_wheels_here():
    """True when the lab's own setuptools can build a wheel (setuptools >= 70.1 has bdist_wheel; older ones need
    the wheel package), so pip need not fetch a build backend."""
    code = "import setuptools, importlib.util as u; assert u.find_spec('setuptools.command.bdist_wheel') " \
           "or u.find_spec('wheel')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    base = tmp_path_factory.mktemp("install")
    source = base / "src"
    source.mkdir()
    for name in SOURCES:  # a copy, so the build's build/ and *.egg-info never land in the repository
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, source / name)
    target = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True, timeout=120, env=env())
    python = target / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    lab = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}  # the lab's numpy, onnx, onnxruntime
    with open(os.path.join(site, "onnx_lab_deps.pth"), "w") as f:
        f.write("\n".join(sorted(lab)) + "\n")
    isolation = ["--no-build-isolation"] if can_build_wheels_here() else []
    done = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-input", *isolation, str(source)],
                          capture_output=True, text=True, timeout=600, env=env(), cwd=base)
    if done.returncode != 0 and any(why in done.stdout + done.stderr for why in OFFLINE):
        pytest.skip("pip cannot reach a build backend (setuptools>=68) here: " + done.stderr.strip()[-200:])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    return target, site, elsewhere


def run(venv, command, *args):
    target, _, elsewhere = venv
    return subprocess.run([str(target / "bin" / command), *args], cwd=elsewhere, capture_output=True, text=True,
                          timeout=300, env=env())


def test_install_puts_the_top_level_modules_into_site_packages(venv):
    target, site, _ = venv
    code = "import sys; " + "; ".join(f"import {m}; print({m}.__file__)" for m in MODULES)
    done = run(venv, "python", "-c", code)
    assert done.returncode == 0, done.stderr
    files = done.stdout.split()
    assert len(files) == len(MODULES) and all(f.startswith(site + os.sep) for f in files), files


@pytest.mark.parametrize("command", COMMANDS)
def test_an_installed_command_runs_from_another_folder_and_names_itself(venv, command):
    shown = run(venv, command, "--help")
    assert shown.returncode == 0 and shown.stdout.startswith(f"usage: {command} "), shown.stdout + shown.stderr
    bad = run(venv, command, "--no-such-option")
    assert bad.returncode == 2 and bad.stderr.startswith(f"{command}: error: ") and bad.stderr.count("\n") == 1, \
        bad.stderr


def test_the_installed_commands_do_their_work_outside_the_repository(venv):
    _, _, elsewhere = venv
    model = os.path.join(ROOT, "tests", "fixtures", "torchscript_tied.onnx")
    inspected = run(venv, "onnx-lab-inspect", model, "--static")
    assert inspected.returncode == 0, inspected.stderr
    assert "stored twice" in inspected.stdout and "holds a transposed duplicate" in inspected.stdout
    exported = run(venv, "onnx-lab-export", "graphs_out")
    assert exported.returncode == 0, exported.stderr
    assert len([f for f in os.listdir(elsewhere / "graphs_out") if f.endswith(".onnx")]) == 7
    compared = run(venv, "onnx-lab-compare", "--vocab-size", "64", "--width", "8", "--format", "float32")
    assert compared.returncode == 0, compared.stdout[-2000:] + compared.stderr[-2000:]
    assert " 0 failed" in compared.stdout
