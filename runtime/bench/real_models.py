"""inspect on models you exported: `python -m runtime.bench.scale --model PATH [PATH ...]` (tests/fixtures/
make_real_exports.py makes SmolLM2's Optimum and onnxruntime-genai exports and a Qwen2.5-0.5B-shaped one).

Each PATH (a model file, or the folder a client loads) is measured as runtime.bench.scale measures a generated
model: each command in a fresh process tree, its summed Pss sampled every 0.1 s (scale.measure), against a plain
session of the same decoder in the same run. The plain session is the client's first step under onnxruntime's
default SessionOptions: load the decoder (genai_config.json's decoder in a genai folder; Optimum's model.onnx or
decoder_model_merged.onnx; a file itself) and run it once on 4 new tokens with empty pasts. The commands:
`inspect PATH`, `--static`, `--retie OUT` and `--retie OUT --logits-to-keep 1`, OUT in a scratch folder. Judged
against issue 47's targets: inspect within 2.5x the session's time and 1.3x its peak, --retie within 5x and 1.5x;
for a session shorter than starting the two interpreters inspect starts (its parent imports numpy and onnx, its
child onnxruntime too: `python -c "import numpy, onnx"`, then `python -c "import numpy, onnx, onnxruntime"`, timed
together in this run), within 2 s and 150 MiB more than the session instead, for every command. --static has no
target."""
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile

from runtime.bench import page
from runtime.bench.measure import measure
from runtime.model.read import layout, sidecars

TARGETS = {"inspect": (2.5, 1.3), "static": (None, None), "retie": (5.0, 1.5), "keep": (5.0, 1.5)}
LABELS = {"keep": "retie --logits-to-keep 1"}
SHORT = (2.0, 150 * 2**20)  # a short session's allowance: seconds and bytes more than it, for every command
TOKENS = 4  # the first step's new tokens
INTERPRETERS = ("import numpy, onnx", "import numpy, onnx, onnxruntime")  # what inspect's parent and its child
# import before any work

_SESSION = """
import json, sys, numpy as np, onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
def dim(d, name):  # a client's first step: batch 1, 4 new tokens, empty pasts; a fixed dim stays as it is
    if isinstance(d, int):
        return d
    d = str(d).lower()
    if "kv_cache" in d or "head" in d:  # genai's head size, from genai_config.json (argv[3])
        return int(sys.argv[3])
    return 1 if "batch" in d else 4 if "total" in d or "+" in d or name == "attention_mask" else 0 if "past" in d else 4
feeds = {}
for i in session.get_inputs():
    shape = [dim(d, i.name) for d in i.shape]
    dtype = np.dtype({"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
                      "tensor(float16)": np.float16}.get(i.type, np.float32))
    if i.name == "input_ids":
        feeds[i.name] = (np.arange(int(np.prod(shape))) * 7 + 1).reshape(shape).astype(dtype)
    elif "position" in i.name:
        feeds[i.name] = np.broadcast_to(np.arange(shape[-1]), shape).astype(dtype)
    else:  # attention_mask ones; use_cache_branch False (a merged decoder's first step); pasts have 0 rows
        feeds[i.name] = np.zeros(shape, dtype) if i.type == "tensor(bool)" else np.ones(shape, dtype)
outputs = session.run(None, feeds)
with open(sys.argv[2], "w") as f:
    json.dump({o.name: list(v.shape) for o, v in zip(session.get_outputs(), outputs)}, f)
"""


def decoder_of(path):
    """The decoder file a client's plain session loads for `path`: itself, genai_config.json's decoder, or the
    merged (else the last) decoder of the files inspect chooses in the folder."""
    if not os.path.isdir(path):
        return path
    named = sidecars.decoder_file(sidecars.genai_config(os.path.join(path, sidecars.GENAI_CONFIG)))
    if named:
        return os.path.join(path, named)
    files, _ = layout.client_files(path)
    decoders = [f for f in files if "decoder" in os.path.basename(f)] or files
    return os.path.join(path, next((f for f in decoders if "merged" in f), decoders[-1]))


def size_bytes(path):
    """The bytes of the file, or of every file in the folder."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def _session(decoder, where):
    """scale.measure of the plain session, with `outputs`: {output: shape} its run wrote (the head size of a
    genai decoder's pasts from its genai_config.json)."""
    shapes = os.path.join(where, "outputs.json")
    head_size = sidecars.genai_head_size(decoder) or 0
    figures = measure([sys.executable, "-c", _SESSION, decoder, shapes, str(head_size)])
    if os.path.exists(shapes):
        with open(shapes) as f:
            figures["outputs"] = json.load(f)
        os.remove(shapes)
    return figures


def measure_model(path, scratch=None, repeat=1):
    """Every command's figures for one model file or folder: {model, decoder, size_bytes, repeat, interpreters,
    baseline, inspect, static, retie, keep}. With `repeat` N, the commands run N times over, in turn (each round
    every command once, so that what drifts on the machine falls on every command alike), each figure the median
    of its N (median). OUT goes to a scratch folder, emptied between commands and removed after."""
    where = tempfile.mkdtemp(prefix="onnx-lab-real-", dir=scratch)
    try:
        decoder = decoder_of(path)
        inspect = [sys.executable, "-m", "runtime.inspect", path]
        out = os.path.join(where, "out" if os.path.isdir(path) else "out.onnx")
        interpreters = ["sh", "-c", " && ".join(f"{shlex.quote(sys.executable)} -c '{imports}'"
                                                for imports in INTERPRETERS)]
        commands = {"interpreters": lambda: measure(interpreters), "baseline": lambda: _session(decoder, where),
                    **{name: lambda extra=extra: measure(inspect + extra) for name, extra in (
                        ("inspect", []), ("static", ["--static"]), ("retie", ["--retie", out]),
                        ("keep", ["--retie", out, "--logits-to-keep", "1"]))}}
        runs = {name: [] for name in commands}
        for _ in range(repeat):
            for name, command in commands.items():
                runs[name].append(command())
                for entry in os.listdir(where):
                    target = os.path.join(where, entry)
                    shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
        return {"model": path, "decoder": os.path.relpath(decoder, path) if decoder != path else "",
                "size_bytes": size_bytes(path), "repeat": repeat, **{n: median(r) for n, r in runs.items()}}
    finally:
        shutil.rmtree(where, ignore_errors=True)


def median(runs):
    """One command's figures from its `runs` (measured alike, in fresh process trees): the median wall time and
    the median peak, each taken on its own (a peak moves with where the allocations fell in the randomized
    address space, from one process to the next, whatever the time), the first run's other fields, and the status
    and error of the first run that failed, if any did."""
    failed = next((r for r in runs if r["status"]), {})
    return {**runs[0], **failed, "wall_s": statistics.median(r["wall_s"] for r in runs),
            "peak_bytes": statistics.median(r["peak_bytes"] for r in runs)}


def short(figures):
    """Whether the plain session is shorter than starting inspect's two interpreters (then SHORT's allowance
    applies)."""
    return figures["baseline"]["wall_s"] < figures["interpreters"]["wall_s"]


def judged(figures):
    """(command, its figures, time ratio, peak ratio, target text, met) for each command measured."""
    base = figures["baseline"]
    for name, (most_time, most_peak) in TARGETS.items():
        if name not in figures:
            continue
        f = figures[name]
        t, p = f["wall_s"] / base["wall_s"], f["peak_bytes"] / max(1, base["peak_bytes"])
        if most_time is None:
            yield name, f, t, p, "no target", None
        elif short(figures):
            met = (f["wall_s"] <= base["wall_s"] + SHORT[0] and f["peak_bytes"] <= base["peak_bytes"] + SHORT[1])
            yield name, f, t, p, f"<= +{SHORT[0]:.0f} s, +{SHORT[1] >> 20} MiB", met and f["status"] == 0
        else:
            met = t <= most_time and p <= most_peak and f["status"] == 0
            yield name, f, t, p, f"<= {most_time}x, {most_peak}x", met


def lines(figures):
    """The report's lines for one model: the session, then each command, its ratios and its target."""
    base, gib = figures["baseline"], 2**30
    decoder = f" (decoder {figures['decoder']})" if figures["decoder"] else ""
    yield (f"{figures['model']}{decoder}, {figures['size_bytes'] / gib:.2f} GiB: plain session {base['wall_s']:.1f} s, "
           f"peak {base['peak_bytes'] / gib:.2f} GiB Pss" + (f"; exit {base['status']}: {base['error']}"
                                                             if base["status"] else "")
           + (f" (shorter than inspect's two interpreters, {figures['interpreters']['wall_s']:.1f} s)" if short(figures)
              else "") + (f"; each figure the median of {figures['repeat']} runs" if figures.get("repeat", 1) > 1
                          else ""))
    for name, f, t, p, target, met in judged(figures):
        verdict = "" if met is None else ": met" if met else ": NOT met"
        yield (f"  {LABELS.get(name, name):<24} {f['wall_s']:6.1f} s = {t:5.2f}x, peak {f['peak_bytes'] / gib:5.2f} "
               f"GiB = {p:4.2f}x (target {target}){verdict}" + (f"; exit {f['status']}: {f['error']}"
                                                                  if f["status"] else ""))


def markdown_table(results):
    """The Markdown rows of BENCHMARKS.md's `scale_real` region, each model named relative to the folder all of
    them lie in."""
    rows, models = [], [os.path.abspath(f["model"]) for f in results]
    common = os.path.commonpath([os.path.dirname(m) for m in models]) if models else ""
    for f, model in zip(results, models):
        base, gib = f["baseline"], 2**30
        label = os.path.relpath(model, common) + (f" ({f['decoder']})" if f["decoder"] else "")
        rows.append([f"{label} ({f['size_bytes'] / gib:.2f} GiB)", "plain session" + (" (short)" if short(f) else ""),
                     f"{base['wall_s']:.1f} s", "1x", f"{base['peak_bytes'] / gib:.2f} GiB", "1x", ""])
        for name, c, t, p, target, met in judged(f):
            label = LABELS.get(name, name) + (f" (exit {c['status']})" if c["status"] else "")
            rows.append(["", label, f"{c['wall_s']:.1f} s", f"{t:.2f}x", f"{c['peak_bytes'] / gib:.2f} GiB",
                         f"{p:.2f}x", "" if met is None else f"{target}: {'met' if met else '**NOT met**'}"])
    return page.table(["model", "command", "wall", "x session", "peak Pss", "x session", "target"],
                      rows or [["not measured"] * 7])
