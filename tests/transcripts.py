"""The docs' transcripts, run again: each ``` block of README.md or docs/*.md that starts with
`$ ./lab_env/python -m ...` (or is compare's default report) is replayed in a fresh folder and its lines compared
with what the commands print now. Figures that move from run to run or machine to machine (MiB measured after a run;
a prefill's time; compare's float differences, whose last digits depend on the CPU's kernels) are compared as '#',
and compare's column padding as one space; every other character must match.
A line `...` in a block stands for any number of lines (and such a block may stop before the run does).

    ./lab_env/python tests/transcripts.py          # print each block's drift as FILE:LINE (exit 1 if any)
    ./lab_env/python tests/transcripts.py --write  # rewrite every block from a run, in whichever file holds it
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

from tests.helpers import ROOT

README = os.path.join(ROOT, "README.md")
COMPARE = "embedding-onnx-lab compare:"
_FLOAT = re.compile(r"\d+\.\d+(e[+-]?\d+)?|\d+e[+-]?\d+")


def pages():
    """README.md and every docs/*.md page, as paths."""
    return [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def where(path, line):
    """'docs/compare.md:12': a block's place, relative to the repository."""
    return f"{os.path.relpath(path, ROOT)}:{line}"


def all_blocks():
    """[(path, start line, lines)] of every transcript block in every page."""
    return [(path, start, body) for path in pages() for start, _, body in blocks(open(path).read())]


def blocks(text):
    """[(start line, end line, lines)] of every ``` block holding a transcript."""
    lines, found, start = text.split("\n"), [], None
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if start is None:
                start = i
                continue
            body = lines[start + 1:i]
            if body and (body[0].startswith("$ ./lab_env/python -m ") or body[0].startswith(COMPARE)):
                found.append((start + 1, i, body))
            start = None
    return found


def _normal(line, compare):
    if line.startswith("  the head: "):  # a prefill's time, measured: every figure moves
        return re.sub(r"\d+(\.\d+)?", "#", line)
    if compare:  # the README shows part of the report, whose columns are as wide as the whole report's
        return re.sub(" +", " ", _FLOAT.sub("#", line))
    return _FLOAT.sub("#", line) if "MiB" in line else line


def replay(body):
    """The lines the block's commands print now (compare's block: a default run), run in a fresh folder where
    `tests` is this repository's tests folder."""
    with tempfile.TemporaryDirectory(prefix="onnx-lab-readme-") as folder:
        os.symlink(os.path.join(ROOT, "tests"), os.path.join(folder, "tests"))
        commands = [["-m", "runtime.compare"]] if body[0].startswith(COMPARE) else [
            line[len("$ ./lab_env/python "):].split() for line in body if line.startswith("$ ")]
        out = []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        for args in commands:
            done = subprocess.run([sys.executable, *args], cwd=folder, capture_output=True, text=True, env=env,
                                  timeout=600)
            if not body[0].startswith(COMPARE):
                out.append("$ ./lab_env/python " + " ".join(args))
            out += done.stdout.rstrip("\n").split("\n")
        return out


def drift(body, now):
    """'' when the block matches the run, else the first line that does not."""
    compare = body[0].startswith(COMPARE)
    if compare:  # the README shows the float32 part: its lines, in order, among the run's
        want = [line for line in body if line.startswith(("PASS |", "FAIL |", COMPARE)) or " passed, " in line]
        got = iter(_normal(line, True) for line in now)
        for line in want:
            if not any(_normal(line, True) == g for g in got):
                return f"not printed now (in this order): {line}"
        return ""
    segments, current = [], []
    for line in body:
        if line == "...":
            segments.append(current)
            current = []
        else:
            current.append(line)
    segments.append(current)
    at = 0
    for k, segment in enumerate(segments):
        norm = [_normal(line, False) for line in segment]
        found = next((i for i in range(at, len(now) - len(norm) + 1)
                      if [_normal(x, False) for x in now[i:i + len(norm)]] == norm), None)
        if found is None or (k == 0 and found != 0):
            return f"block differs from the run near: {segment[0] if segment else '(end)'}"
        at = found + len(norm)
    if len(segments) == 1 and at != len(now):  # a block with no `...` shows the whole run
        return f"the run prints more: {now[at]}"
    return ""


def rewrite(text):
    """A page's text with each block replaced by a fresh run (compare's: its float32 part)."""
    lines = text.split("\n")
    for start, end, body in reversed(blocks(text)):
        now = replay(body)
        if body[0].startswith(COMPARE):  # its float32 part: the lines of graphs not named @format, the notes kept
            notes = [line for line in body if line.startswith("(")]
            checks = [line for line in now if line.startswith(("PASS |", "FAIL |")) and "@" not in line.split("|")[2]]
            now = [now[0]] + checks + notes + [line for line in now if " passed, " in line]
        if "..." in body:  # the elided form: the run up to its initializer table, then the lines the block kept
            cut = next((i for i, line in enumerate(now) if line.startswith("  name ")), len(now))
            tail = {_normal(t, False) for t in body[body.index("...") + 1:]}
            now = now[:cut] + ["..."] + [line for line in now[cut:] if _normal(line, False) in tail]
        lines[start:end] = now
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        for path in pages():
            text = open(path).read()
            if blocks(text) and (fresh := rewrite(text)) != text:
                with open(path, "w") as f:
                    f.write(fresh)
                print(f"rewrote {os.path.relpath(path, ROOT)}")
        sys.exit(0)
    if sys.argv[1:]:
        sys.exit("usage: tests/transcripts.py [--write]")
    bad = [(where(path, start), why) for path, start, body in all_blocks() if (why := drift(body, replay(body)))]
    for place, why in bad:
        print(f"{place}: {why}")
    sys.exit(1 if bad else 0)
