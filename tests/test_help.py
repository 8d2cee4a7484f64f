"""Every command's --help and the README say the same: each option the help lists, and each default of two
digits or more it gives (after the word "default"), appears in the README's section on that command (a new option or a changed default fails here until the README
says it too)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {  # the command, and the heading of its README section
    ("-m", "runtime.compare"): "## The main job",
    ("-m", "graphs.export"): "## The graphs, in Netron",
    ("-m", "runtime.inspect"): "## Inspecting any model",
    ("-m", "runtime.bench"): "## Memory and speed",
    ("embed.py",): "## The reference",
}


def section(heading):
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def help_of(command):
    done = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, COLUMNS="100"))
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("command", list(COMMANDS), ids=lambda c: c[-1])
def test_every_option_in_help_is_in_the_readme(command):
    text, shown = section(COMMANDS[command]), help_of(command)
    flags = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", shown)) - {"--help"})
    assert flags, shown
    missing = [flag for flag in flags if flag not in text]
    assert not missing, f"{' '.join(command)} --help lists {missing}; README's {COMMANDS[command]!r} does not"


@pytest.mark.parametrize("command", list(COMMANDS), ids=lambda c: c[-1])
def test_every_default_in_help_is_in_the_readme(command):
    text, shown = section(COMMANDS[command]), " ".join(help_of(command).split())
    defaults = [v for v in re.findall(r"\(default:? ([\w.,-]+?)[;),\s]", shown) if re.fullmatch(r"\d[\d.]+", v)]
    near = " ".join(text.split())  # the README's words, its line breaks aside
    missing = [v for v in defaults if not re.search(rf"default[^.;]{{0,60}}?(?<![\w.]){re.escape(v)}(?![\w.])", near)]
    assert not missing, f"{' '.join(command)} --help gives defaults {missing}; README's {COMMANDS[command]!r} does not"
