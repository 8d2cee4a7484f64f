"""The graphs a run checks and their onnxruntime sessions, each built once, in one scratch folder."""
import os

import graphs
from graphs import precision
from graphs.export import build_all
from runtime.compare.pool import Pool, quiet
from runtime.compare.sizes import measure_sizes  # the one check whose work runs in the second process
from runtime.optimized import optimized_model
from runtime.runner import Runner


class Sessions:
    """Models by name (the seven exported graphs; others built on demand), saved once with external data so each
    session maps its tables from the file, and one Runner per model."""

    def __init__(self, config, folder, pool=None, progress=quiet):
        self.config, self.folder, self.progress = config, folder, progress
        self.pool = pool or Pool(enabled=False)
        self.runners, self._cache = {}, {}
        args = (config.vocab, config.width, config.seed, folder)
        self.pool.submit(("sizes",), measure_sizes, args, lambda: measure_sizes(*args))

    def models(self):
        """The seven exported graphs {file name: model}, built from graphs.make_table once."""
        if "models" not in self._cache:
            self.progress("building the seven graphs")
            self._cache["models"] = build_all(self.config.vocab, self.config.width, self.config.seed)
        return self._cache["models"]

    def model(self, name):
        return self.models()[f"{name}.onnx"]

    def saved(self, name, model=None):
        """The path of graph `name` (or of `model`, under that name), saved once with its tables as external data."""
        path = os.path.join(self.folder, f"{name}.onnx")
        if not os.path.exists(path):
            graphs.save(self.model(name) if model is None else model, path, external=True, check=False)
        return path

    def runner(self, name, model=None):
        """One session per graph, made on first use: an exported graph by name, or `model` under a new name."""
        if name not in self.runners:
            self.runners[name] = Runner(self.saved(name, model))
        return self.runners[name]

    def optimized(self, name):
        """onnxruntime's optimized model of graph `name` under its defaults, prepacked copies recorded."""
        return self.cached(("optimized", name),
                           lambda: optimized_model(self.saved(name), self.folder, f"{name}.optimized.onnx"))

    def stored(self, table32, fmt, block_size):
        """The table quantized to `fmt` once (graphs.precision.store), for every graph in that format."""
        return self.cached(("stored", fmt, block_size), lambda: precision.store(table32, fmt, block_size))

    def model_at(self, name, table32, fmt, block_size):
        """Graph `name` built on the table stored in `fmt`, once (a head at the configured accuracy level)."""
        level = {"accuracy_level": self.config.accuracy_level} if name.endswith("_logits") else {}
        return self.cached(("model", name, fmt, block_size), lambda: getattr(graphs, name)(
            self.stored(table32, fmt, block_size), fmt=fmt, block_size=block_size, **level))

    def head32(self):
        """The untied head's table, as graphs makes it (seed + 1)."""
        return self.cached(("head32",), lambda: graphs.make_table(self.config.vocab, self.config.width,
                                                                  self.config.seed + 1))

    def sizes(self):
        """What graphs.save writes for the tied and untied heads (runtime.compare.sizes.measure_sizes)."""
        return self.cached(("sizes",), lambda: self.pool.result(("sizes",), self.progress))

    def cached(self, key, compute):
        """compute() once per key."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def export(self, folder):
        """Write the seven graphs to `folder` (never over a file)."""
        os.makedirs(folder, exist_ok=True)
        for name, model in self.models().items():
            graphs.save(model, os.path.join(folder, name))
        return len(self.models())
