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


MAX_MODULE_LINES = 300  # a module past this has more than one job: split it by what each part does


def test_structure_modules_within_bounds():
    found = [f"{os.path.relpath(p, ROOT)}: {n} lines" for p in python_files()
             if (n := sum(1 for _ in open(p, encoding="utf-8"))) > MAX_MODULE_LINES]
    assert not found, f"module(s) past {MAX_MODULE_LINES} lines:\n" + "\n".join(found)


def module_name(path):
    """graphs/storage.py -> graphs.storage; a package's __init__.py -> the package."""
    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def imported(path, modules):
    """The project's modules `path` imports anywhere in it (a lazy import inside a function too): `from a.b import
    c` names a.b.c where that is a module, else a.b."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), filename=path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in found if m in modules and m != name}


def circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
            elif step not in index:
                index[step] = low[step] = counter[0]
                counter[0] += 1
                stack.append(step)
                on.add(step)
                work.append((step, iter(sorted(graph[step]))))
            elif step in on:
                low[node] = min(low[node], index[step])
    return found


def test_structure_finds_an_import_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_structure_no_import_circle_lazy_imports_included():
    paths = list(python_files())
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imported(p, modules) for p in paths}
    found = circles(graph)
    assert not found, "modules that import each other (a lazy import hides, not breaks, a circle):\n" + \
        "\n".join(" <-> ".join(c) for c in found)
