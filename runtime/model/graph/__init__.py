"""The graph: producers and consumers in every scope, constants and attributes, the tables and heads found in it,
and quantized layouts read back as values."""
