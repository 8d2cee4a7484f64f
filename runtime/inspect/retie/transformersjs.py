"""A transformers.js folder as transformers.js reads it back: each model file's external data in data files of its
own beside it, `onnx/<file>_data` then `_data_1`, ... (`model.onnx_data`), and config.json's
`transformers.js_config.use_external_data_format` giving their count. Its browser build (onnxruntime-web) fetches
exactly those names, and only when the config says so; a shared `model.data` it cannot load ("Module.MountedFiles
is not available"). Node's onnxruntime reads whatever location a file names."""
import json
import math
import os

from graphs.together import chunk_names
from runtime.model.read import sidecars
from runtime.model.read.layout import DTYPES

CHUNK_BYTES = 2**31  # each chunk below 2 GiB: the browser fetches a chunk into one ArrayBuffer
CONFIG = "config.json"
KEY = "use_external_data_format"
# transformers.js's dtype suffixes (layout.DTYPES, fp32's '' aside): `model_q4f16.onnx` is session `model` at q4f16
_SUFFIXES = tuple(s for s in DTYPES.values() if s)


class Config:
    """config.json of the transformers.js folder at `root`, to be written into OUT (beside onnx/) once the model
    files `names` (OUT-relative) are written, saying how many data chunks each has."""

    def __init__(self, root, names, say):
        self.names_, self.value, self.data = names, None, None
        raw = sidecars.read(os.path.join(root, CONFIG), CONFIG)
        try:
            self.config = json.loads(raw) if raw is not None else None
        except (ValueError, RecursionError):
            self.config = None
        if not isinstance(self.config, dict):  # changed since the folder was read: say it, and write no config
            self.config = None
            say(f"retie: {CONFIG} of {root}: no longer a JSON object; OUT gets none, so transformers.js's browser "
                f"build will not find the data files\n")

    def written(self, written):
        """{config.json: its bytes} for save_together's `then`, or {} where the config already gives every file
        its chunk count (none needed, or as it said)."""
        if self.config is None:
            return {}
        counts = {os.path.basename(n): len(chunk_names(written, n)) for n in self.names_}
        section = self.config.get("transformers.js_config")
        section = section if isinstance(section, dict) else {}
        devices = section.get("device_config") if isinstance(section.get("device_config"), dict) else {}
        sections = [section] + [s for s in devices.values() if isinstance(s, dict) and KEY in s]
        if all(chunks(s.get(KEY), full) == n for s in sections for full, n in counts.items()):
            return {}
        for s in sections:  # device_config's own value overrides the top one for that device: it says the same
            s[KEY] = given(s.get(KEY), counts)
        self.config["transformers.js_config"] = section
        self.value = section[KEY]
        try:
            self.data = (json.dumps(self.config, indent=2) + "\n").encode()
        except RecursionError:  # nested deeper than the writer goes: copied as it is, and said
            self.value = None
            return {}
        return {CONFIG: self.data}

    def names(self):
        """The sidecars OUT has from here (not to be copied over)."""
        return (CONFIG,) if self.data is not None else ()

    def said(self):
        """What the config says now, for the retie's line."""
        if self.data is None:
            return ""
        return f"; {CONFIG}: transformers.js_config.{KEY} {json.dumps(self.value, separators=(', ', ': '))}"


def chunks(value, full):
    """How many data chunks transformers.js loads for file `full` (`model_fp16.onnx`) given `value` (its
    resolveExternalDataFormat: an object by file name, then by session name; else one value for every file; a
    value read as a JavaScript number, 0 for anything else)."""
    if isinstance(value, dict):
        stem = session(full)
        value = value[full] if full in value else value[stem] if stem in value else 0
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return int(value)
    if isinstance(value, str):
        try:
            return int(float(value.strip() or 0))
        except (ValueError, OverflowError):
            return 0
    return 0


def given(value, counts):
    """`value` made to give each file of `counts` {file: chunks} its count: an object by file name, keeping the
    entries for other files (a number or true for every file becomes per-file entries for these)."""
    new = dict(value) if isinstance(value, dict) else {}
    for full, n in counts.items():
        if n or chunks(new, full):  # 0 said only where a session-name entry would say otherwise
            new[full] = n
    return new


def session(full):
    """The session name transformers.js asks for with `full`: `model_q4f16.onnx` -> `model`."""
    stem = full[:-len(".onnx")] if full.endswith(".onnx") else full
    return next((stem[:-len(s)] for s in _SUFFIXES if stem.endswith(s)), stem)
