"""The lab's graphs on a real table: each built by graphs' own builder, saved in a scratch folder with the table's
bytes in one data file they all name (so the table lies once on disk and its sessions map the same pages), and
one session each, opened on first use and closed when asked."""
import os

import numpy as np
import onnx

import graphs
from graphs.arrays import release, write_array
from runtime.runner import Runner

DATA = "table.data"
BUILDERS = {"gather_lookup": graphs.gather_lookup, "onehot_lookup": graphs.onehot_lookup,
            "scaled_lookup": graphs.scaled_lookup,
            "neighbors_cosine": lambda t: graphs.neighbors(t, "cosine"),
            "neighbors_dot": lambda t: graphs.neighbors(t, "dot")}


def _write(path, values):
    """`values` written to `path` in blocks of rows; their pages let go as they go."""
    shell = onnx.TensorProto(name="embedding", data_type=onnx.TensorProto.FLOAT, dims=values.shape)
    with open(path, "wb") as f:
        write_array(f, values, shell)


class Lab:
    """The graphs of BUILDERS on `values` (float32 [vocab, width]) in `folder`. `values` is then this table as a
    memory map of the data file the sessions read (`data`): one copy of its pages, however many read it. Every
    graph's file is written by build(), or on first use. A session loads the table into memory of its own where a kernel
    needs it whole, so runs open one at a time (close()). `zero_rows`: the table's all-zero rows (Table.zero_rows),
    which the cosine lists and hub counts leave out."""

    def __init__(self, values, folder, zero_rows=()):
        self.folder, self.runners, self.zero_rows = folder, {}, tuple(zero_rows)
        self.data = os.path.join(folder, DATA)
        _write(self.data, values)
        release(values)
        self.values = np.memmap(self.data, np.float32, "r", shape=values.shape)

    def build(self):
        """Write every graph's file now, while little else is held (the caller has let the decoded table go):
        each build holds a copy of the table for a while."""
        for name in BUILDERS:
            self._shell(name)

    def _shell(self, name):
        """The file of graph `name` on the table: built by its builder on the real table, its `embedding` then
        saved as a reference to the shared data file. Only the file is kept: the built model's protobuf holds
        the table's bytes until it is destroyed, clearing the field does not free them."""
        path = os.path.join(self.folder, f"{name}.{DATA}.onnx")
        if not os.path.exists(path):
            model = BUILDERS[name](self.values)  # the builder's own graph, checked on the real table
            _point(model, DATA, self.values.nbytes)
            onnx.save_model(model, path)
            del model
            release(self.values)
        return path

    def path(self, name, data=DATA):
        """The file of graph `name` whose table is the data file `data` in the folder."""
        path = os.path.join(self.folder, f"{name}.{data}.onnx")
        if not os.path.exists(path):
            model = onnx.load(self._shell(name), load_external_data=False)  # small: the table stays in its file
            _point(model, data, self.values.nbytes)
            onnx.save_model(model, path)
        return path

    def runner(self, name, data=DATA, arena=False):
        """A session of graph `name` (on data file `data`), prepacking off: no kernel holds a packed copy beside
        the table; its threads do not spin between runs (the reference's workers want the cores). `arena`: keep
        onnxruntime's CPU arena, for many runs of one shape."""
        key = (name, data)
        if key not in self.runners:
            self.runners[key] = Runner(self.path(name, data), prepacking=False, arena=arena, spinning=False)
        return self.runners[key]

    def stretched(self, token_id, factor):
        """The name of a data file holding the table with row `token_id` times `factor` (the product rounded to
        float32, as the reference's is: a power of two keeps it exact)."""
        data = f"stretched-{token_id}-x{factor:g}.data"
        path = os.path.join(self.folder, data)
        if not os.path.exists(path):
            _write(path, self.values)
            with open(path, "r+b") as f:
                f.seek(token_id * self.values.shape[1] * 4)
                f.write((self.values[token_id].astype(np.float64) * factor).astype(np.float32).tobytes())
            release(self.values)
        return data

    def close(self, name=None):
        """Close graph `name`'s sessions (every session when None): their memory goes with them."""
        for key in [k for k in self.runners if name in (None, k[0])]:
            del self.runners[key]


def _point(model, data, length):
    """Make `model`'s `embedding` initializer name data file `data` (offset 0, `length` bytes) as its values."""
    tensor = next(t for t in model.graph.initializer if t.name == "embedding")
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", data), ("offset", "0"), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
