"""python -m runtime.inspect MODEL.onnx [--json] [--retie OUT.onnx]: find tied, duplicated and runtime-copied
tables in a model nobody vouched for.

reading: parse and check every tensor, lazily; walk: graph order and the tables and heads in it; relations:
pairs and runtime copies; isolated: onnxruntime in a child under limits; proof and retie: --retie; cli: the
command.
"""
from runtime.inspect.cli import inspect_model, main
from runtime.inspect.reading import InspectError, load
from runtime.inspect.relations import relate
from runtime.inspect.walk import find_tables_and_heads

__all__ = ["InspectError", "find_tables_and_heads", "inspect_model", "load", "main", "relate"]
