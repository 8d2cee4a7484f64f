"""ONNX builders for the embedding lab: each returns a checked onnx.ModelProto."""
from graphs.builders import gather_lookup, neighbors, onehot_lookup, scaled_lookup, tied_logits, untied_logits
from graphs.storage import save
from graphs.table import make_table

__all__ = ["gather_lookup", "onehot_lookup", "tied_logits", "untied_logits", "scaled_lookup", "neighbors",
           "make_table", "save"]
