"""One onnxruntime session per model, with the id check ONNX itself does not make."""
import os

import numpy as np
import onnx
import onnxruntime as ort


_NUMPY = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
          "tensor(float16)": np.float16, "tensor(double)": np.float64, "tensor(bool)": np.bool_}


def session_options(optimized_model_path=None, prepacking=True, arena=False):
    """The lab's session settings, chosen by measurement (BENCHMARKS.md, `python -m runtime.bench`).

    Prepacking on, as in onnxruntime's defaults: the lab's tied heads read their table through a run-time view
    (graphs.tie), which nothing prepacks, so the tie holds without turning it off; every other constant weight
    (an untied head, a real model's other MatMuls) is packed once at load and its original freed, the same bytes
    and a faster head for more than one token. The CPU arena off: it keeps freed activation buffers, about 0.17x
    the table's bytes after a 64-token run of a 50257 x 768 tied head.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only: the optimized-model warning is expected here
    options.add_session_config_entry("session.disable_prepacking", "0" if prepacking else "1")
    options.enable_cpu_mem_arena = arena
    if optimized_model_path is not None:
        options.optimized_model_filepath = os.fspath(optimized_model_path)
    return options


def read_data_from(options, folder):
    """Tell `options` where the external data of a model given as a ModelProto or as bytes lies (a path's own
    folder is used for a path); nothing when `folder` is None. Returns `options`."""
    if folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", os.fspath(folder))
    return options


def vocab_size_of(model):
    """The model's vocabulary: its `vocab_size` metadata, else the rows of the table a Gather reads `ids` from."""
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get("vocab_size", "").isdigit():
        return int(meta["vocab_size"])
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == "ids" and node.input[0] in shapes:
            return shapes[node.input[0]][0]
    return None


def check_ids(ids, vocab_size, name="ids"):
    """`ids` as int64, or a one-line ValueError: Gather would wrap a negative id, OneHot zero an out-of-range one."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array, got dtype {ids.dtype}")
    if vocab_size is not None and ids.size:
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            where = np.unravel_index(bad[0], ids.shape)
            raise ValueError(f"{name}: id {ids[where]} at position {tuple(int(i) for i in where)} "
                             f"is out of range [0, {vocab_size})")
    return ids.astype(np.int64, copy=False)


class Runner:
    """A session for a ModelProto or a path; run(feeds) -> {output name: array}."""

    def __init__(self, model, optimized_model_path=None, arena=False, data_folder=None, spinning=True,
                 disabled_optimizers=(), prepacking=True):
        """arena=True keeps onnxruntime's CPU arena: faster for large batches (activations are reused rather
        than faulted in each run) at the price of holding them between runs. `data_folder`: where the external
        data of a ModelProto passed in lies (a path's own folder is used for a path). spinning=False stops the
        session's threads from spinning after a run (for sessions timed against one another).
        `disabled_optimizers`: onnxruntime graph transformers to skip, as open_session takes them; prepacking=False
        sets session.disable_prepacking (every kernel reads its weights as stored)."""
        options = session_options(optimized_model_path, prepacking=prepacking, arena=arena)
        if not spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        read_data_from(options, data_folder)
        self.session = open_session(model, options, disabled_optimizers)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.vocab_size = self._vocab_size(model)
        self._input_types = {i.name: i.type for i in self.session.get_inputs()}
        self._input_shapes = {i.name: i.shape for i in self.session.get_inputs()}
        self._output_types = {o.name: o.type for o in self.session.get_outputs()}
        self._output_shapes_declared = {o.name: o.shape for o in self.session.get_outputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]

    def _vocab_size(self, model):
        """vocab_size_of(model) for the ids check, from the session's metadata where it has `vocab_size` (the lab's
        graphs do), None where no input is named `ids` (nothing is checked), and only otherwise from the ModelProto.
        A path is not parsed in Python if it can be helped: onnx.load reads a model's inline tensors in full, and
        once those buffers are freed glibc keeps the heap onnxruntime then grows into (its mmap threshold rises to
        their size), about 0.77x table_bytes resident after one run of the 50257 x 768 int4 tied head."""
        meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get("vocab_size", "").isdigit():
            return int(meta["vocab_size"])
        if "ids" not in self.input_names:
            return None
        return vocab_size_of(model if isinstance(model, onnx.ModelProto) else
                             onnx.load(os.fspath(model), load_external_data=False))

    def run(self, feeds, outputs=None, out=None):
        """{output name: array} for `outputs` (default: all).

        When the inputs settle every output's shape (the declared dims, symbolic ones named by an input), the
        outputs are numpy arrays onnxruntime writes into through an IOBinding: numpy backs a large array with
        transparent huge pages, so 100 MiB of logits take about 560 page faults rather than malloc's 25 600
        (BENCHMARKS.md, section c). Otherwise onnxruntime allocates them.

        `out` {name: array} gives preallocated arrays for some outputs, written in place and returned as they are
        (for callers that loop: no new buffer and no page faults on it each run); each must be C-contiguous,
        writable, of the output's dtype and of the shape this run produces."""
        unknown = sorted(set(feeds) - set(self.input_names))
        if unknown:
            raise ValueError(f"unknown input {unknown[0]!r}; the model takes {self.input_names}")
        feeds = dict(feeds)
        if "ids" in feeds:
            feeds["ids"] = check_ids(feeds["ids"], self.vocab_size)
        if "k" in feeds:
            feeds["k"] = check_ids(feeds["k"], None, "k")
            if (feeds["k"] < 0).any():
                raise ValueError(f"k must be >= 0, got {feeds['k'].tolist()}")
        names = list(outputs or self.output_names)
        if out:
            return self._run_into(feeds, names, out)
        shapes = self._output_shapes(feeds, names)
        if shapes is None:  # a shape the inputs do not settle (a KV cache's total length): onnxruntime allocates
            return dict(zip(names, self.session.run(names, feeds)))
        try:
            arrays = {name: np.empty(shape, _NUMPY[self._output_types[name]]) for name, shape in shapes.items()}
            return self._bound(feeds, names, arrays)
        except (ValueError, MemoryError):  # declared shapes wrong for this run (or absurd): onnxruntime says how
            return dict(zip(names, self.session.run(names, feeds)))

    def _output_shapes(self, feeds, names):
        """{name: shape} for outputs `names` from their declared dims, with each symbolic dim taken from the inputs
        that declare it; None if any dim is unknown, or two inputs disagree on one, or an input's dtype is not the
        model's (left to onnxruntime's own error)."""
        sizes = {}
        for name, value in feeds.items():
            if not isinstance(value, np.ndarray) or value.dtype != _NUMPY.get(self._input_types[name]):
                return None
            declared = self._input_shapes[name]
            if len(declared) != value.ndim:
                return None
            for dim, size in zip(declared, value.shape):
                if isinstance(dim, str) and sizes.setdefault(dim, size) != size:
                    return None
        shapes = {}
        for name in names:
            shape = [dim if isinstance(dim, int) and dim >= 0 else sizes.get(dim) if isinstance(dim, str) else None
                     for dim in self._output_shapes_declared[name]]
            if self._output_types[name] not in _NUMPY or None in shape:
                return None
            shapes[name] = shape
        return shapes

    def _run_into(self, feeds, names, out):
        """The run through an IOBinding whose outputs in `out` are the caller's arrays."""
        strange = sorted(set(out) - set(names))
        if strange:
            raise ValueError(f"out names {strange[0]!r}, which is not an output asked for ({names})")
        for name, array in out.items():
            want = _NUMPY[self._output_types[name]]
            if not isinstance(array, np.ndarray) or array.dtype != want or not array.flags.c_contiguous \
                    or not array.flags.writeable:
                raise ValueError(f"out[{name!r}] must be a writable C-contiguous {np.dtype(want).name} array")
        inputs = {name: np.ascontiguousarray(value, dtype=_NUMPY[self._input_types[name]])
                  for name, value in feeds.items()}
        return self._bound(inputs, names, out)

    def _bound(self, feeds, names, arrays):
        """Run with `feeds` bound in place and outputs written into `arrays` {name: array} (the others allocated
        by onnxruntime); a run that fails (typically a shape unlike this run's output) is a one-line ValueError."""
        inputs = {name: np.ascontiguousarray(value) for name, value in feeds.items()}  # held: the binding points in
        binding = bind(self.session, inputs, names, arrays)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as e:
            raise ValueError(f"run into out= failed: {str(e).splitlines()[0]}") from None
        produced = binding.get_outputs() if set(names) - set(arrays) else None
        return {name: arrays[name] if name in arrays else produced[i].numpy() for i, name in enumerate(names)}


def open_session(model, options=None, disabled_optimizers=()):
    """An onnxruntime CPU session on a ModelProto, serialized bytes or a path, with the lab's settings unless
    `options` are given; `disabled_optimizers` names graph transformers to skip (e.g. "ConstantFolding")."""
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else \
        model if isinstance(model, bytes) else os.fspath(model)
    options = options or session_options()
    return ort.InferenceSession(spelled(source, options), options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=set(disabled_optimizers))


def spelled(source, options):
    """`source` (a path or a serialized model) as onnxruntime can take it: a path no UTF-8 spells (a file name of
    undecodable bytes, surrogate-escaped by os.fsdecode) is read here and given as bytes, `options` then told to
    read its external data from the file's own folder; onnxruntime's Python binding takes str paths as UTF-8 only."""
    if not isinstance(source, str) or _utf8(source):
        return source
    read_data_from(options, os.path.dirname(source))
    with open(source, "rb") as f:
        return f.read()


def _utf8(text):
    """Whether `text` encodes as UTF-8 (a file name os.fsdecode made of undecodable bytes does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def bind(session, inputs, names, arrays):
    """An IOBinding of `session` with `inputs` {name: C-contiguous array} bound in place and each output of `names`
    bound to its array in `arrays`, or left to onnxruntime to allocate. The arrays must outlive the binding:
    onnxruntime holds raw pointers into them."""
    binding = session.io_binding()
    for name, value in inputs.items():
        binding.bind_cpu_input(name, value)
    for name in names:
        if name in arrays:
            array = arrays[name]
            binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        else:
            binding.bind_output(name, "cpu")
    return binding


def run(model, feeds):
    """Runner(model).run(feeds) in one call."""
    return Runner(model).run(feeds)
