"""The optimized model onnxruntime writes as a session opens (SessionOptions.optimized_model_filepath): with its
data, or its layout alone (the data thrown away), each prepacked copy recorded beside the initializer it was made
from where prepacking is on. What it holds is read by runtime.resident and runtime.inspect."""
import contextlib
import os

import onnx

from runtime.runner import open_session, read_data_from, session_options


def write_optimized_model(model, path, prepacked=False, data_folder=None):
    """Write the model onnxruntime runs after its own graph optimisations to `path` (a ModelProto or a path in).

    Large initializers go to `path + ".data"`, so models past 2 GiB work too. `prepacked`: load it as onnxruntime's
    default SessionOptions do (prepacking on) and record each prepacked copy beside the initializer it was made
    from (an external-data entry `prepacked_<i>` = "<kernel>+<hash>|<offset>;<length>;..."; the copy's bytes go
    to the data file too), so the copies no initializer shows can be counted and attributed. `model` may be a
    serialized model too, its external data in `data_folder`.
    """
    options = read_data_from(session_options(path, prepacking=prepacked), data_folder)
    open_session(model, writing(options, path, prepacked))


def writing(options, path, prepacked=True):
    """`options` (returned) set to write the optimized model to `path` as a session opens, its initializers in
    `path` + ".data" and, with `prepacked`, each prepacked copy recorded beside its initializer (write_optimized_model's
    settings)."""
    path = os.fspath(path)
    options.optimized_model_filepath = path
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                     os.path.basename(path) + ".data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    if prepacked:
        options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    return options


@contextlib.contextmanager
def data_thrown_away(path):
    """Inside the block, the data file of an optimized model written to `path` is /dev/null: onnxruntime writes
    the model's layout (every initializer's dims and offsets, each prepacked copy's length, as a real write records
    them: it counts the offsets itself) and no byte of tensor data. A 3 GiB model's data would be 5 GiB to write
    (every weight again and each prepacked copy: 10-25 s here)."""
    data = os.fspath(path) + ".data"
    os.symlink(os.devnull, data)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):  # onnxruntime removes a data file it sees empty
            os.remove(data)


def write_optimized_layout(model, path, data_folder=None, prepacking=True):
    """write_optimized_model(prepacked=True), its data thrown away (data_thrown_away): the layout alone at `path`
    (with `prepacking` False, no kernel prepacks and none of its copies is recorded)."""
    layout_session(model, path, data_folder, prepacking=prepacking)


def layout_session(model, path, data_folder=None, data=False, prepacking=True):
    """A session on `model` under the lab's settings, prepacking on (unless `prepacking` is False), that wrote its
    optimized model's layout to `path` as it opened (write_optimized_layout), or with `data` the model with its
    data (write_optimized_model): one load both runs the model and says what it holds. It keeps a copy of every
    tensor onnxruntime holds in its own memory (inline or folded: runtime.resident.owned_bytes)."""
    options = read_data_from(session_options(prepacking=prepacking), data_folder)
    with contextlib.nullcontext() if data else data_thrown_away(path):
        return open_session(model, writing(options, path, prepacked=prepacking))


def optimized_model(model, folder, name="optimized.onnx"):
    """The model onnxruntime runs after its own graph optimisations under its default SessionOptions, as it writes
    it out (tensor data not loaded), its prepacked copies recorded (runtime.resident.prepacked_copies reads them)."""
    path = os.path.join(folder, name)
    write_optimized_model(model, path, prepacked=True)
    return onnx.load(path, load_external_data=False)
