"""A model nobody vouched for, read and understood without running it: shared by runtime.inspect and
runtime.compare --model, so both commands read a model the same way and neither imports the other.

Packages, one way down (each imports only those before it):

  read/      checked bytes: the model reader (model), the checked-source contract (checked), the files beside a model
             (sidecars), the files a folder's client loads (layout), printable text and InspectError (text)
  graph/     the graph: scopes, producers and consumers, tables and heads (walk), quantized layouts (quantized)
  findings/  relations and runtime copies (relations), parameters, row scale, token or position (shares), what a
             session holds (counting), a folder's files related (across)

None of them imports onnxruntime.
"""
