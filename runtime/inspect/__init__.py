"""python -m runtime.inspect MODEL.onnx|FOLDER [--json] [--retie OUT]: find tied, duplicated and runtime-copied
tables in a model nobody vouched for.

Below it, shared with runtime.compare --model: runtime.model (read/: checked bytes; graph/: the tables and heads
found; findings/: relations, copies, shares, counting, prefill, a folder's files related). Its own packages, one way
down (each imports only those before it):

  sandbox/   onnxruntime, in a child under limits (isolated, child, guard), the feeds (feeds), memory measured
             (memory), the retie proof the child runs (proof)
  retie/     --retie: the rules (rules), the rewrite (rewrite, edits, packed), writing a file (write) or folder (folder)

and on top: examine (one file), examine_folder (a folder), report (the text and --json), cli (the command).

Importing the package imports none of them: each name below is loaded on first use, so the isolated child, or a
caller that only reads files, never pays for the command line.
"""
import importlib

_HOMES = {"InspectError": "runtime.model.read.text", "load": "runtime.model.read.model",
          "find_tables_and_heads": "runtime.model.graph.walk", "inspect_model": "runtime.inspect.examine",
          "inspect_folder": "runtime.inspect.examine_folder", "main": "runtime.inspect.cli",
          "relate": "runtime.model.findings.relations"}

__all__ = sorted(_HOMES)


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'runtime.inspect' has no attribute {name!r}")
