"""What each job the isolated child runs does (runtime.inspect.sandbox.child dispatches to these by the job's
kind): build a model's optimized model, measure a session or a folder's sessions together, prove a retie, time a
prefill, check a lookup from the head. Each imports onnxruntime's side lazily: the child's module starts lean."""
import os

from runtime.model.read.checked import source
from runtime.inspect.sandbox import ahead, answers, folding


def _model(job):
    """(the model as its user's session opens it, the folder of its data or None; the model as a shell, its folder;
    the shell's ModelProto, small): for job["checked"] (the user's model) what checked.source hands out (the file that
    was checked, by its descriptor; its shell, each large tensor read where it lies), else job["model"] (a file this
    tool wrote in its scratch folder) both times."""
    if "checked" not in job:
        return (job["model"], None), (job["model"], None), _proto(job["model"])
    checked = source(job["checked"])
    return checked.as_user(), checked.as_shell(), _proto(checked.as_shell()[0])


def optimize(job):
    """answers.Optimized: onnxruntime's optimized model written to job["out"], its prepacked copies recorded. With
    job["sizes"] (the element counts of the tensors whose copies are looked for), its layout, without data, and what
    a copy of one of those sizes needs to be compared (_data_written: told by the node that folded it, or the data
    written). Written from the model's shell: the optimized model is the same, its large tensors not parsed into a
    protobuf first."""
    import onnxruntime

    from runtime.optimized import write_optimized_layout, write_optimized_model
    _, shell, proto = _model(job)
    version = onnxruntime.__version__  # whose folding and prepacking is described
    if job.get("sizes") is None:
        write_optimized_model(shell[0], job["out"], prepacked=True, data_folder=shell[1])  # the defaults' prepacks
        return answers.Optimized(version, data=True)
    write_optimized_layout(shell[0], job["out"], data_folder=shell[1])
    return answers.Optimized(version, **_data_written(job["out"], shell, proto, _proto(job["out"]), job["sizes"]))


def _proto(model):
    """The ModelProto of `model` (serialized bytes, or a path: read as its shell, runtime.model.read.wire), its large
    tensors' data not read."""
    import onnx

    from runtime.model.read.wire import read_file
    return onnx.load_model_from_string(model if isinstance(model, bytes) else read_file(model).data)


def _copies_to_compare(original, layout, sizes):
    """Whether the optimized model `layout` holds a tensor onnxruntime made (resident.made) of one of `sizes`
    elements (None: any): a possible copy of a table, whose values the layout alone does not show."""
    import math

    from runtime.resident import made
    return sizes is None or any(math.prod(t.dims) in set(sizes) for t in made(original, layout))


def measure(job):
    """answers.Measured: what a session adds after one run of the proof's decoder feeds, in this fresh process,
    opened as its user opens it. With job["layout"], its `optimized` also says what the optimize job's would and
    how many bytes writing the layout held beside the session measured (owned_bytes: the figures stand only where
    that is small): where the model holds its large tensors inline (as its shell left them in the file, or a shell
    past OWNED_MOST), a second session, from the shell, writes the layout after the first is measured and let go;
    otherwise the session measured writes it as it opens (one load for both)."""
    import onnxruntime

    from runtime.feeds import first_feeds
    from runtime.resident import let_go, owned_bytes, session_growth
    (model, folder), (shell, shell_folder), proto = _model(job)
    feeds = first_feeds(proto, job["rows"], job["shape"])
    if not job.get("layout"):
        return answers.Measured(answers.Figures(**session_growth(model, feeds, job["prepacking"], data_folder=folder)))
    if _layout_apart(job, model, shell, proto):
        figures = session_growth(model, feeds, job["prepacking"], data_folder=folder)
        let_go()  # the session measured: gone before the next one opens
        written, saved, unrecorded = _written_apart((shell, shell_folder), job["layout"], proto, job.get("sizes"),
                                                    job)
        owned = 0
    else:  # with its data at once where a copy to compare will be made (folding.made_at_load)
        written = folding.made_at_load(job.get("sizes"))
        figures, saved = ahead.measured_showing(job, (model, folder), proto, feeds, written)
        owned, unrecorded = None, None
    layout = _proto(job["layout"])
    return answers.Measured(answers.Figures(**figures), answers.Optimized(
        onnxruntime.__version__, originals=saved, unrecorded=unrecorded,
        owned_bytes=owned_bytes(proto, layout) if owned is None else owned,
        **_data_written(job["layout"], (shell, shell_folder), proto, layout, job.get("sizes"), written)))


def _layout_apart(job, model, shell, proto):
    """Whether the layout is written from a session of its own once the one measured is let go: where writing it
    from the measured session would hold more than OWNED_MOST beside it (resident.owned_bytes), as when the model
    holds its large tensors inline (as its shell left them in the file, or more than OWNED_MOST of tensors in its
    protobuf: folding.inline_bytes), holds float16 /
    bfloat16 weights past OWNED_MOST, which the CPU provider widens into float32 copies of its own, or has a weight
    folded into a tensor that stays held once written (folding.folds_held)."""
    from runtime.resident import OWNED_MOST
    if "checked" not in job:
        return False
    return (isinstance(model, str) or folding.inline_bytes(proto) > OWNED_MOST
            or folding.half_bytes(proto) > OWNED_MOST or folding.folds_held(proto))


def _written_apart(shell, path, proto, sizes, job=None):
    """Write the optimized model at `path` from a session of its own on the model's shell (shell, its folder): its
    layout, or, where the optimizer will make a tensor of one of `sizes` elements whose values are then compared
    (folding.made_at_load; `sizes` None: any), the model with its data at once, one session fewer. (Whether the data
    was written, the original's outputs saved for a --retie's proof or None, probed.unrecorded's Unrecorded or None):
    where `job` (a measure job or part) is proving (jobs.proving), the session that writes it, the layout or the
    model with its data, shows the heads' hidden vectors and runs the proof's feeds (ahead.run_ahead). A layout
    alone that runs no feeds is written with prepacking off where probed.packing_off allows (issue 57's decision): the
    packings of the tables' copies are probed apart. (The proof's reference is the original as its client runs it,
    prepacking on: a MatMul on a packed weight sums in another order.)"""
    from runtime.inspect.sandbox import probed
    from runtime.optimized import layout_session, write_optimized_layout, write_optimized_model
    data = folding.made_at_load(sizes)
    shown, model = ahead.shown_copy(proto, job["proving"]["show"]) if (job or {}).get("proving") else (None, None)
    packing = data or model is not None or not probed.packing_off(proto)
    if model is not None:  # the same session runs the proof's feeds: the proof loads the original no more
        folder = shell[1] or os.path.dirname(os.path.abspath(shell[0]))
        try:  # the same layout: only values no fusion reads are shown (originals.shown_ahead)
            session = layout_session(model, path, data_folder=folder, data=data, prepacking=packing)
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001 - onnxruntime refusing the model with them shown: the layout as it is
            session = None
        if session is not None:  # prepacking on: its outputs are the client's run
            return data, ahead.run_ahead(session, shown, proto, job), None
    if data:
        write_optimized_model(shell[0], path, prepacked=True, data_folder=shell[1])
        return data, None, None
    write_optimized_layout(shell[0], path, data_folder=shell[1], prepacking=packing)
    if packing:
        return data, None, None
    try:
        return data, None, probed.unrecorded(_proto(path), sizes)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - a node onnxruntime refuses alone: the layout again, its packings recorded
        os.remove(path)
        write_optimized_layout(shell[0], path, data_folder=shell[1])
        return data, None, None


def _data_written(path, shell, proto, layout, sizes, written=False):
    """answers.Optimized's {"data": whether the file at `path` is the optimized model with its data, "written": whether
    what the parent compares is in it}. Where the optimized model `layout` (written at `path`) holds a tensor
    onnxruntime made of one of `sizes` elements (_copies_to_compare), the node constant folding made it of says which
    weight it holds and how (folding.folded_from, "folded"; no data file), or, where one was made some other way, the
    optimized model is written again at `path` with its data, from the model's shell (shell, its folder), in a session
    of its own once the one measured is let go: no child of its own, one process start fewer. `written`: the data is
    there already (_written_apart)."""
    from runtime.resident import let_go
    from runtime.optimized import write_optimized_model
    if not _copies_to_compare(proto, layout, sizes):
        return {"data": False, "written": False}
    if written:
        return {"data": True, "written": True}
    folded = folding.folded_from(proto, layout, sizes)
    if folded is not None:  # each copy told by its node: no value read, no data file written
        return {"data": False, "written": True, "folded": folded}
    let_go()
    os.remove(path)
    write_optimized_model(shell[0], path, prepacked=True, data_folder=shell[1])
    return {"data": True, "written": True}


def measure_together(job):
    """answers.Together: what sessions on every file of a folder add when one process holds them all (Pss), after
    one run each. Where the parts name a "layout", each file's optimized model's layout is written there too, and
    its `layouts` says for each part what its optimize job would, and owned_bytes, as measure's does: a
    file whose large tensors are external data writes it in the session measured (one load for both), one that holds
    them inline from its shell in a session of its own once every session measured is let go."""
    import onnxruntime

    from runtime.feeds import first_feeds
    from runtime.resident import let_go, owned_bytes
    models, protos, shells, later, showing = [], [], [], [], {}
    for i, part in enumerate(job["files"]):
        (model, folder), shell, proto = _model(part)
        layout = part.get("layout")
        inline = layout and _layout_apart(part, model, shell[0], proto)
        models.append((model, folder, first_feeds(proto, part["rows"], part["shape"]), None if inline else layout,
                       bool(layout) and not inline and folding.made_at_load(part["sizes"])))
        protos.append(proto if layout else None)
        shells.append(shell)
        later += [(shell, layout, proto, part)] if inline else []
        proving = layout and not inline and part.get("proving")
        shown, copy = ahead.shown_copy(proto, part["proving"]["show"]) if proving else (None, None)
        if copy is not None:  # its session measured shows the heads' hidden vectors, then runs the proof's feeds
            showing[i] = (shown, copy.SerializeToString())
    figures, given = ahead.together_showing(models, showing, protos, job)
    if not any(part.get("layout") for part in job["files"]):
        return answers.Together(answers.Figures(**figures))
    let_go()  # the sessions measured: gone before a layout's own session opens
    apart = {layout: _written_apart(shell, layout, proto, part["sizes"], part) for shell, layout, proto, part in later}
    layouts = []
    for i, (part, proto, shell, run) in enumerate(zip(job["files"], protos, shells, models)):
        if proto is None:
            layouts.append(None)
            continue
        layout = _proto(part["layout"])
        owned = 0 if part["layout"] in apart else owned_bytes(proto, layout)
        written, saved, unrecorded = apart.get(part["layout"], (run[4], given.get(i), None))  # as it opened, or apart
        layouts.append(answers.Optimized(onnxruntime.__version__, owned_bytes=owned, originals=saved,
                                         unrecorded=unrecorded,
                                         **_data_written(part["layout"], shell, proto, layout, part["sizes"], written)))
    return answers.Together(answers.Figures(**figures), layouts)


def prove(job):
    """answers.Proved: the proof's failures and, where the retied model's session wrote its optimized model's
    layout, whether that layout holds a tensor of job["sizes"] elements it did not (its data then written there too,
    to be compared), the session's figures where job["measure"], the bytes writing the layout held
    (resident.owned_bytes), and where the weights are read in place how far the other outputs lie from the
    original's under the defaults (proof._drift)."""
    import onnxruntime

    from runtime.inspect.sandbox.proof import OriginalFails, prove
    from runtime.resident import owned_bytes
    try:
        proven = prove(job)
    except OriginalFails as e:
        return answers.Proved([], original=str(e))
    answer = answers.Proved(proven.failures, kept=proven.kept, drift=proven.drift, heads=proven.heads)
    if not job.get("layout"):
        return answer
    retied, layout = _proto(job["after"]), _proto(job["layout"])
    return answer._replace(
        measured=None if proven.figures is None else answers.Figures(**proven.figures),
        optimized=answers.Optimized(onnxruntime.__version__, owned_bytes=owned_bytes(retied, layout), **_data_written(
            job["layout"], (job["after"], None), retied, layout, job.get("sizes"), proven.written)))


def prefill(job):
    """answers.Timed: one profiled run of the model at job["tokens"] prompt tokens (runtime.inspect.sandbox.timing)."""
    from runtime.inspect.sandbox import timing
    (model, folder), _, proto = _model(job)
    return timing.run(job, model, folder, proto)


def head_lookup(job):
    """answers.LookedUp: --lookup-from-head's rows checked for every id and its greedy tokens
    (runtime.inspect.sandbox.headrows)."""
    from runtime.inspect.sandbox import headrows
    return headrows.check(job)


def quality(job):
    """answers.Quality: a lossy retie's price, teacher-forced over a text (runtime.inspect.sandbox.quality)."""
    from runtime.inspect.sandbox import quality as measured
    return measured.measure(job)
