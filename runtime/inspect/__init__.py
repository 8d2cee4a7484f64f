"""python -m runtime.inspect MODEL.onnx|FOLDER [--json] [--retie OUT]: find tied, duplicated and runtime-copied
tables in a model nobody vouched for.

reading: parse and check every tensor, lazily; walk: graph order and the tables and heads in it; quantized:
codes of any layout read back as values; relations: pairs and runtime copies; shares: parameters, row scale,
token or position; feeds: the decoder inputs the model is run on; isolated: onnxruntime in a child under limits,
child: that child's entry point; memory: what a session holds; examine: one file, everything its report shows;
folder: the files a client loads together, related across files; proof, retie, retie_edits, retie_packed and
retie_folder: --retie; sidecars: the files beside a model; report: the text and --json; cli: the command.

Importing the package imports none of them: each name below is loaded on first use, so the isolated child, or a
caller that only reads files, never pays for the command line.
"""
import importlib

_HOMES = {"InspectError": "reading", "load": "reading", "find_tables_and_heads": "walk", "inspect_model": "examine",
          "main": "cli", "relate": "relations"}

__all__ = sorted(_HOMES)


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(f"runtime.inspect.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'runtime.inspect' has no attribute {name!r}")
