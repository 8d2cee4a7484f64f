"""The only place that touches onnxruntime: limits, the isolated child and its entry module, the signal guard, the
feeds a model is run on, memory measured in a child, and the retie proof the child runs."""
