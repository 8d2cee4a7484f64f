"""The only place that touches onnxruntime: limits, the isolated child and its entry module, the signal guard, the
feeds a model is run on, memory measured in a child, and the retie proof the child runs. What the parent asks the
child is made in jobs, what the child says back is typed in answers."""
