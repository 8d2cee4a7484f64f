"""ONNX builders for the embedding lab: each returns a checked onnx.ModelProto."""
