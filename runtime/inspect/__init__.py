"""python -m runtime.inspect MODEL.onnx [--json] [--retie OUT.onnx]: find tied, duplicated and runtime-copied
tables in a model nobody vouched for.

reading: parse and check every tensor, lazily; walk: graph order and the tables and heads in it; quantized:
codes of any layout read back as values; relations: pairs and runtime copies; shares: parameters, row scale,
token or position; feeds: the decoder inputs the model is run on; isolated: onnxruntime in a child under limits;
memory: what a session holds; proof and retie: --retie; sidecars: the files beside a model; report: the text and
--json; cli: the command.
"""
from runtime.inspect.cli import inspect_model, main
from runtime.inspect.reading import InspectError, load
from runtime.inspect.relations import relate
from runtime.inspect.walk import find_tables_and_heads

__all__ = ["InspectError", "find_tables_and_heads", "inspect_model", "load", "main", "relate"]
