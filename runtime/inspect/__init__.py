"""python -m runtime.inspect MODEL.onnx|FOLDER [--json] [--retie OUT]: find tied, duplicated and runtime-copied
tables in a model nobody vouched for.

Packages, one way down (each imports only those before it):

  read/      checked bytes: the model reader (model), the checked-source contract (checked), the files beside a model
             (sidecars), the files a folder's client loads (layout), printable text and InspectError (text)
  graph/     the graph: scopes, producers and consumers, tables and heads (walk), quantized layouts (quantized)
  findings/  relations and runtime copies (relations), parameters, row scale, token or position (shares), what a
             session holds (counting), a folder's files related (across)
  sandbox/   onnxruntime, in a child under limits (isolated, child, guard), the feeds (feeds), memory measured
             (memory), the retie proof the child runs (proof)
  retie/     --retie: the rules (rules), the rewrite (rewrite, edits, packed), writing a file (write) or folder (folder)

and on top: examine (one file), examine_folder (a folder), report (the text and --json), cli (the command).

Importing the package imports none of them: each name below is loaded on first use, so the isolated child, or a
caller that only reads files, never pays for the command line.
"""
import importlib

_HOMES = {"InspectError": "read.text", "load": "read.model", "find_tables_and_heads": "graph.walk",
          "inspect_model": "examine", "inspect_folder": "examine_folder", "main": "cli",
          "relate": "findings.relations"}

__all__ = sorted(_HOMES)


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(f"runtime.inspect.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'runtime.inspect' has no attribute {name!r}")
