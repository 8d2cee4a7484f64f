"""Every command's --help and its docs page say the same: each option the help lists, and each default of two
digits or more it gives (after the word "default"), appears in the section of the page that documents that command (a
new option or a changed default fails here until the page says it too)."""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

COMMANDS = {  # the command, the page that documents it, and the heading of the section holding its options
    ("-m", "runtime.compare"): ("docs/compare.md", "## Options"),
    ("-m", "graphs.export"): ("docs/export.md", "# The graphs"),
    ("-m", "runtime.inspect"): ("docs/inspect.md", "## Options"),
    ("-m", "runtime.bench"): ("docs/bench.md", "# Memory and speed"),
    ("embed.py",): ("docs/embed.md", "# The reference"),
}


def section(where):
    """The text from the heading to the next heading of its level or above."""
    page, heading = where
    text = open(os.path.join(ROOT, page)).read()
    start = re.search(rf"^{re.escape(heading)}\b", text, flags=re.M).start()
    level = len(heading.split(" ")[0])
    end = re.compile(rf"^#{{1,{level}}} ", flags=re.M).search(text, start + len(heading))
    return text[start:end.start() if end else len(text)]


def help_of(command):
    done = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, COLUMNS="100"))
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("command", list(COMMANDS), ids=lambda c: c[-1])
def test_every_option_in_help_is_in_its_docs(command):
    text, shown = section(COMMANDS[command]), help_of(command)
    flags = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", shown)) - {"--help"})
    assert flags, shown
    missing = [flag for flag in flags if flag not in text]
    assert not missing, f"{' '.join(command)} --help lists {missing}; {' '.join(COMMANDS[command])!r} does not"


@pytest.mark.parametrize("command", list(COMMANDS), ids=lambda c: c[-1])
def test_every_default_in_help_is_in_its_docs(command):
    text, shown = section(COMMANDS[command]), " ".join(help_of(command).split())
    defaults = [v for v in re.findall(r"\(default:? ([\w.,-]+?)[;),\s]", shown) if re.fullmatch(r"\d[\d.]+", v)]
    near = " ".join(text.split())  # the page's words, its line breaks aside
    missing = [v for v in defaults if not re.search(rf"default[^.;]{{0,60}}?(?<![\w.]){re.escape(v)}(?![\w.])", near)]
    assert not missing, f"{' '.join(command)} --help gives defaults {missing}; {' '.join(COMMANDS[command])!r} does not"
