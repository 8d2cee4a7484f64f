"""python -m runtime.bench [--quick] [--json PATH] [--markdown FILE] [--plot FILE.png]: memory and speed at real
vocabulary sizes.

Every figure is a ratio to a baseline measured in the same run (numpy take, numpy's matmul in a clean child
process, the table's own bytes), so it means the same on a loaded machine. Times are the minimum over repeats
(noise only ever adds time). Progress goes to stderr, the table to stdout. Modules: `timing` (how things are
timed), `lookups` (a, b), `head` (c, e), `memory` (d), `formats` (d'), `probes` (the fresh processes), `summary`
(the report), `markdown` (--markdown's tables, each with the run's date and machine), `cli`; `folders` (a shipped folder before
and after --retie, and inspect's own cost: python -m runtime.bench.folders).

Importing the package imports none of them (each name below is loaded on first use): a benchmark that only
starts inspect's children, as folders does, keeps onnxruntime out of its own process, as inspect does.
"""
import importlib

_HOMES = {"main": "cli", "bench_floor": "head", "bench_head": "head", "WIDTH": "lookups",
          "bench_format_lookups": "lookups", "bench_lookups": "lookups", "bandwidth": "formats",
          "bench_formats": "formats", "bench_memory": "memory", "report": "summary", "targets": "summary",
          "bound_run": "timing", "race": "timing", "session": "timing"}

__all__ = sorted(_HOMES)


_MODULES = {"cli", "folders", "formats", "head", "lookups", "markdown", "memory", "page", "probes", "summary", "timing"}


def __getattr__(name):
    """A name of _HOMES, imported on first use and kept; or a submodule. No function is named like its module: the
    import system sets the package's attribute to a submodule when it loads it, whoever imports it first."""
    if name in _HOMES:
        value = globals()[name] = getattr(importlib.import_module(f"runtime.bench.{_HOMES[name]}"), name)
        return value
    if name in _MODULES:
        return importlib.import_module(f"runtime.bench.{name}")
    raise AttributeError(f"module 'runtime.bench' has no attribute {name!r}")
