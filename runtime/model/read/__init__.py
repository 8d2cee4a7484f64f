"""Checked bytes: the model reader (every tensor checked before it is read, external data kept inside the model's
folder), the checked-source contract a child relies on, the files beside a model, the files a folder's client
loads, and printable text. Imports neither onnxruntime nor the command line."""
