"""The project's size rule, read from the source by ast: functions stay within 60 lines and 7 parameters."""
import ast
import os

from tests.helpers import ROOT

MAX_LINES, MAX_PARAMS = 60, 7
SOURCES = ["graphs", "runtime", "embed.py"]  # relative to ROOT; folders are walked


def python_files():
    for source in SOURCES:
        path = os.path.join(ROOT, source)
        if os.path.isfile(path):
            yield path
            continue
        for folder, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            yield from (os.path.join(folder, f) for f in sorted(files) if f.endswith(".py"))


def lines(function):
    """The def line to the last line; decorators are not counted."""
    return function.end_lineno - function.lineno + 1


def params(function):
    """Every parameter, *args and **kwargs one each; a leading self or cls is not counted."""
    a = function.args
    named = [p.arg for p in a.posonlyargs + a.args]
    if named[:1] in (["self"], ["cls"]):
        named = named[1:]
    return len(named) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def oversized(path):
    """'path:line name: N lines, M parameters' for each function of `path` past either bound."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n, m = lines(node), params(node)
            if n > MAX_LINES or m > MAX_PARAMS:
                yield f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name}: {n} lines, {m} parameters"


def test_structure_counts_lines_and_parameters():
    source = ("class C:\n"
              "    @cached\n"
              "    def f(self, a, /, b, *args, c, **kwargs):\n"
              "        return (a,\n"
              "                b)\n")
    f = ast.parse(source).body[0].body[0]
    assert (lines(f), params(f)) == (3, 5)  # decorator left out; self left out; *args and **kwargs one each


def test_structure_functions_within_bounds():
    found = [f for path in python_files() for f in oversized(path)]
    assert not found, (f"{len(found)} function(s) past {MAX_LINES} lines or {MAX_PARAMS} parameters:\n"
                       + "\n".join(found))
