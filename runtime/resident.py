"""Resident memory as the kernel counts it, split into anonymous (heap, prepacked copies) and file-backed
(tensor data onnxruntime maps from the model's files) pages, and what one session adds to it."""
import collections
import contextlib
import gc
import math
import os

import numpy as np
from onnx import TensorProto, helper

from graphs.bodies import graph_paths  # a graph's paths, named as inspect names them
from graphs.storage import BITS

Resident = collections.namedtuple("Resident", "rss anonymous file")

OWNED_MOST = 2**20  # what writing an optimized model's layout may hold (owned_bytes) beside a session measured
MAPPED_ALONE = 32 * 2**20  # glibc's malloc gives an allocation this large its own mapping, unmapped when freed


def _kib(path, keys):
    """{key: bytes} of the `kB` lines named `keys` in a /proc file."""
    fields = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                fields[key] = int(value.split()[0]) * 1024
    return fields


def resident():
    """This process's resident bytes now: Resident(rss, anonymous, file) from /proc/self/status."""
    fields = _kib("/proc/self/status", ("VmRSS", "RssAnon", "RssFile", "RssShmem"))
    return Resident(fields["VmRSS"], fields["RssAnon"], fields["RssFile"] + fields.get("RssShmem", 0))


def proportional():
    """This process's proportional set size now: Resident(pss, anonymous, file) from /proc/self/smaps_rollup, where
    a page mapped by several sessions (one external data file two sessions map) counts once in all."""
    fields = _kib("/proc/self/smaps_rollup", ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"))
    return Resident(fields["Pss"], fields["Pss_Anon"], fields["Pss_File"] + fields.get("Pss_Shmem", 0))


def options(prepacking=True):
    """SessionOptions as a user has them: onnxruntime's defaults, with prepacking turned off if asked."""
    import onnxruntime as ort  # here, not at import: inspect's parent never loads it (see isolated)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not prepacking:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    return opts


def _warm():
    """One session on a one-node model first, so onnxruntime's process-wide set-up (its environment, kernel
    registries, the first thread pool) is not counted against the model measured next."""
    import onnxruntime as ort  # here, not at import: inspect's parent never loads it (see isolated)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "warm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    ort.InferenceSession(model.SerializeToString(), options(), providers=["CPUExecutionProvider"]).run(
        None, {"x": np.ones(1, np.float32)})


def session_growth(path, feeds, prepacking=True, disabled_optimizers=(), data_folder=None, layout=None, keep=None):
    """{resident_bytes, anonymous_bytes, file_bytes}: what a session on the model at `path` (or serialized, its
    external data in `data_folder`) adds to this process after loading and one run on `feeds` (its outputs
    dropped, the session still held; `disabled_optimizers`: graph transformers skipped). Meant for a fresh
    process: memory an earlier session freed to the allocator would hide part of this one's. `layout`: the
    session also writes its optimized model's layout there as it opens (optimized.data_thrown_away); it then holds
    owned_bytes() more, which the caller must find small for the figures to stand. `keep`: a list the session is
    appended to, for a caller that runs it on (otherwise it is let go)."""
    return sessions_growth([(path, data_folder, feeds, layout)], prepacking, disabled_optimizers, measure=resident,
                           keep=keep)


def made(original, layout):
    """The initializers (TensorProtos) the optimized model `layout` (a ModelProto) holds that `original` does not,
    in that graph: the tensors onnxruntime's optimizer made (folded, cast, transposed)."""
    before = {path: {t.name for t in g.initializer} for path, _, g in graph_paths(original.graph)}
    return [t for path, _, g in graph_paths(layout.graph) for t in g.initializer if t.name not in before.get(path, ())]


def owned_bytes(original, layout):
    """The bytes a session that wrote the optimized model `layout` (a ModelProto) holds once more for having written
    it: those of the tensors onnxruntime holds in its own memory, as `layout` lists them, namely each it made
    (made()) and each `original` stores inline. Tensors `original` stores as external data are mapped, and written
    from where they lie. Under glibc a tensor of MAPPED_ALONE bytes or more is not counted: its serialized copy is
    an allocation past malloc's largest mmap threshold (mallopt(3): 32 MiB on 64-bit), mapped for it alone and
    given back when freed, so the session holds nothing more for it once written (measured: onnxruntime-genai's
    SmolLM2 fp32, whose 108 MiB folded transposed head is such a tensor, added 633.4 MiB with its layout written as
    it opened, 627.5 MiB without), unless a kernel prepacked it: a session that writes its prepacked copies keeps
    such a tensor too, where one that does not frees it once packed (measured: a Qwen2.5-shaped Optimum export,
    whose 519 MiB folded transposed head MatMul prepacks, added 2449.9 MiB with its layout written as it opened,
    1911.9 MiB without)."""
    external = {(path, t.name) for path, _, g in graph_paths(original.graph) for t in g.initializer
                if t.data_location == TensorProto.EXTERNAL}
    sizes = [((math.prod(t.dims) * BITS.get(t.data_type, 64) + 7) // 8,
              any(e.key.startswith("prepacked") for e in t.external_data))
             for path, _, g in graph_paths(layout.graph) for t in g.initializer if (path, t.name) not in external]
    return sum(size for size, packed in sizes if packed or held_once_written(size))


def held_once_written(nbytes):
    """Whether owned_bytes counts a tensor of `nbytes`: its serialized copy stays in the heap once written (below
    MAPPED_ALONE, or wherever malloc does not map large allocations alone)."""
    return nbytes < MAPPED_ALONE or not _mapped_alone()


def _mapped_alone():
    """Whether this process's malloc maps each allocation of MAPPED_ALONE bytes or more on its own (glibc's, unless
    MALLOC_MMAP_MAX_=0 turned its mmap off)."""
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError):
        glibc = False
    return glibc and os.environ.get("MALLOC_MMAP_MAX_", "").strip() != "0"


def sessions_growth(models, prepacking=True, disabled_optimizers=(), measure=proportional, keep=None):
    """{resident_bytes, anonymous_bytes, file_bytes, peak_bytes, kept_bytes}: what sessions on every model of
    `models` [(path or serialized model, data folder or None, feeds[, layout[, with data]])], all held at once in
    this process as a client holds them, add after one run each, as `measure` reads it (Pss by default: pages two
    sessions map count once), and the most resident memory (RSS) they added at any moment on the way (None where
    Linux does not say). The figures are read once glibc has returned the free heap it kept (malloc_trim):
    memory onnxruntime freed while a session opened that glibc keeps for reuse, whose amount depends on where
    the allocations fell in this process's randomized address space (SmolLM2's inline Optimum export: 643 MiB
    held, and 0 to 296 MiB more kept, from one fresh process to the next; steady with ASLR off). `kept_bytes` is
    that free heap, which the process holds until it reuses or returns it;
    for a fresh process, like session_growth. A model given a layout path (not None) writes its optimized model's
    layout there as its session opens (session_growth's `layout`), or, with data true, the optimized model with its
    data (optimized.writing: written through the page cache, which no process's resident set counts)."""
    import onnxruntime as ort  # here, not at import: inspect's parent never loads it (see isolated)

    from runtime.optimized import data_thrown_away, writing
    from runtime.runner import read_data_from, spelled
    _warm()
    let_go()  # what glibc kept of earlier work is not counted against the sessions
    before, peaks = measure(), _reset_peak()
    sessions = []
    for model, data_folder, feeds, *written in models:
        layout, data = (written + [None, False])[:2]
        settings = read_data_from(options(prepacking), data_folder)
        with data_thrown_away(layout) if layout and not data else contextlib.nullcontext():
            settings = writing(settings, layout) if layout else settings
            sessions.append(ort.InferenceSession(spelled(model, settings), settings, providers=["CPUExecutionProvider"],
                                                 disabled_optimizers=set(disabled_optimizers)))
        sessions[-1].run(None, feeds)
    peak = _kib("/proc/self/status", ("VmHWM",)).get("VmHWM") if peaks else None
    untrimmed = measure()
    after = measure() if give_back_heap() else untrimmed  # what the sessions hold: the free heap glibc kept returned
    if keep is not None:
        keep += sessions
    del sessions
    return {"resident_bytes": after.rss - before.rss, "anonymous_bytes": after.anonymous - before.anonymous,
            "file_bytes": after.file - before.file, "peak_bytes": None if peak is None else peak - peaks,
            "kept_bytes": max(0, untrimmed.rss - after.rss)}


def _reset_peak():
    """Reset this process's resident high-water mark (VmHWM) to what it holds now, as Linux allows a process for
    itself (/proc/self/clear_refs "5"): the RSS it holds then, or None where it cannot (the peak is not given)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return resident().rss
    except OSError:
        return None


def readers(model):
    """{tensor name: [the nodes that read it]} of a ModelProto's main graph, each node once per tensor."""
    reading = {}
    for node in model.graph.node:
        for name in dict.fromkeys(node.input):
            reading.setdefault(name, []).append(node)
    return reading


def scoped(name, graph):
    """The key of initializer `name` of subgraph `graph` (a path of runtime.model.read.model.graph_paths) among the
    main graph's names: the name itself in the main graph."""
    return name if graph in (None, "main") else f"{name}\x1f{graph}"


def unscoped(key):
    """(name, graph path or None for the main graph) of a scoped() key."""
    name, _, graph = key.partition("\x1f")
    return name, graph or None


def _initializers(model):
    """[(key (scoped), TensorProto, {name: the nodes of its graph that read it})] of the main graph and every body."""
    found = []
    for path, _, graph in graph_paths(model.graph):
        if not len(graph.initializer):
            continue
        reading = {}
        for node in graph.node:
            for name in dict.fromkeys(node.input):
                reading.setdefault(name, []).append(node)
        found += [(scoped(t.name, path), t, reading) for t in graph.initializer]
    return found


def prepacked_copies(optimized):
    """[{initializer, kernel, node, bytes}]: each copy a kernel prepacked at load, as onnxruntime records it beside
    the initializer it was made from in an optimized model (a ModelProto, tensor data not loaded) written by
    runtime.optimized.write_optimized_model(prepacked=True); in a subgraph, `initializer` is scoped()."""
    copies = []
    for key, tensor, reading in _initializers(optimized):
        entries = [e.value for e in tensor.external_data if e.key.startswith("prepacked")]
        for i, value in enumerate(entries):
            kernel, _, rest = value.partition("+")
            fields = rest.partition("|")[2].split(";")  # offset; length; ...
            length = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0
            nodes = [n for n in reading.get(tensor.name, []) if n.op_type == kernel]
            node = nodes[min(i, len(nodes) - 1)] if nodes else None
            copies.append({"initializer": key, "kernel": kernel, "bytes": length,
                           "node": None if node is None else (node.name or node.output[0])})
    return copies


_INDEXED = {}  # id(model) -> (model, its initializers' keys, {key: readers}): asked once per table of one model


def _indexed(model):
    hit = _INDEXED.get(id(model))
    if hit is None or hit[0] is not model:
        if len(_INDEXED) >= 4:
            _INDEXED.clear()
        found = _initializers(model)
        hit = _INDEXED[id(model)] = (model, {key for key, *_ in found},
                                     {key: reading.get(t.name, []) for key, t, reading in found})
    return hit[1], hit[2]


def originals_held(names, optimized, prepacked, prepacking):
    """Which of the tensors `names` a session keeps as they are stored: those its optimized model keeps, less each
    every reader of which prepacked it when prepacking is on (onnxruntime then frees it)."""
    kept, reading = _indexed(optimized)  # names of subgraph initializers scoped()
    present = [n for n in dict.fromkeys(names) if n in kept]
    if not prepacking:
        return present
    packed = {n: sum(p["initializer"] == n for p in prepacked) for n in present}
    return [n for n in present if not (packed[n] and packed[n] >= len(reading.get(n, [])))]


def copies_held(names, optimized, prepacked, prepacking):
    """How many copies of the tensors `names` (a table, a duplicate of it, the copies folded from them) a session
    holds: those it keeps as stored (originals_held), plus the prepacked copies of them when prepacking is on."""
    held = len(originals_held(names, optimized, prepacked, prepacking))
    if not prepacking:
        return held
    present = set(names) & _indexed(optimized)[0]
    return held + sum(p["initializer"] in present for p in prepacked)


def let_go():
    """Return what this process freed to the system (a session let go): collected, and glibc's free heap trimmed
    (malloc_trim), so that the next session's peak is its own. Nothing where the C library has no malloc_trim."""
    gc.collect()
    give_back_heap()


def give_back_heap():
    """glibc's malloc_trim(0): every free page of its heaps returned to the system (a parse that builds and drops
    much, a tokenizer.json of 33 MB in the tokenizers library, leaves 300 MiB freed but resident otherwise).
    Whether it could be called (nothing happens elsewhere than glibc)."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
