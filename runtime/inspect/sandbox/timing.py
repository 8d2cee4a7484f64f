"""The head's share of a prefill: the decoder run once on a prompt of the stated length (no past) in the isolated
child, in a session under onnxruntime's default SessionOptions with its profiler on; the head's kernels' time (the
nodes whose output is vocabulary-wide) against the whole run's. A run past MOST_FLOPS (its head's, or each weight
used once a token) is not made (the command's own time is the budget); the report says so and how to state a
shorter prompt."""
import glob
import json
import os

from runtime.model.graph.ops import PROFILED_MATMULS
from runtime.model.read.text import InspectError
from runtime.inspect.sandbox import answers, isolated, jobs

MOST_FLOPS = 10**12  # multiply-adds x 2 of the prefill (its head, or every weight once a token) past which no run is
# made: ~10 s on this 2-core machine
MOST_SECONDS = 120  # and the most the run may take (or a third of the command's time left, if less)


def time_prefill(model, info, folder, limits):
    """Add `timing` to each of info.prefill (findings.prefill.all_positions' entries): {"run_seconds",
    "head_seconds"} of one run at its prompt length, or {"why"}: why none was made (too many multiply-adds for
    inspect's budget, a run onnxruntime refused, feeds that cannot be made)."""
    found = info.prefill or []
    if not found:
        return
    tokens = found[0]["prompt_tokens"]
    widths = {h.initializer: h.width for h in info.heads}
    head = sum(2 * tokens * p["vocab_size"] * widths.get(p["head"], 0) for p in found)
    weights = 2 * tokens * sum(t.elements for t in model.tensors.values())  # each weight used once a token, at least
    if max(head, weights) > MOST_FLOPS:
        why = (f"not timed: a {tokens}-token prefill is at least {_flops(max(head, weights))} (the head alone "
               f"{_flops(head)}), past inspect's budget of {_flops(MOST_FLOPS)}; --prompt-length N times a shorter one")
        for p in found:
            p["timing"] = {"why": why}
        return
    logits = sum(p["logits_bytes"] for p in found)
    need, available = model.file_bytes * 5 // 4 + 2 * logits + isolated.GiB // 2, isolated.available_memory()
    if available and available < need:
        for p in found:
            p["timing"] = {"why": f"not timed: a {tokens}-token prefill needs about {need / isolated.GiB:.1f} GiB, "
                                  f"{available / isolated.GiB:.1f} GiB is available now"}
        return
    vocab = sorted({p["vocab_size"] for p in found})
    job = jobs.prefill(model.checked, folder, info.rows, info.shape, tokens, vocab)
    seconds = min(MOST_SECONDS, limits.remaining() / 3)
    own = isolated.Limits(seconds, limits.memory, limits.progress)
    try:  # its own share of the command's time: a prefill too slow to time leaves the rest theirs
        timing = isolated.call(job, f"running a {tokens}-token prefill once", own, model.file_bytes).entry()
    except InspectError as e:  # out of memory, out of its time, refused: said, never the command's failure
        if own.remaining() <= 0.001:
            why = f"not timed: the run took past its own budget of {seconds:.0f} s"
        else:
            why = f"not timed: {str(e).split(': ', 1)[-1] if isinstance(e, isolated.StepFailed) else e}"
        timing = {"why": why}
    for p in found:
        p["timing"] = timing


def _flops(count):
    """'1.2 TFLOP', '35.1 GFLOP', '4.2 MFLOP'."""
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count / 1e6:.1f} MFLOP"


def run(job, model, folder, proto):
    """In the child: one run of `model` (bytes or a path; its data in `folder`) at job["tokens"] new tokens and no
    past, profiled: an answers.Timed, its `why` set where its feeds cannot be made."""
    import onnxruntime as ort

    from runtime.feeds import NoFeeds, no_past_branch, shaped_feeds
    from runtime.runner import read_data_from
    try:
        feeds = shaped_feeds(proto, job["rows"], dict(job["shape"], past=0), job["tokens"])
    except NoFeeds as e:
        return answers.Timed(why=f"not timed: {e}")
    no_past_branch(feeds)  # a merged decoder's prefill: the branch that reads no past
    options = read_data_from(ort.SessionOptions(), folder)  # onnxruntime's defaults, its profiler on
    options.log_severity_level = 3
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(job["folder"], "prefill_profile")
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    path = session.end_profiling()
    del session
    try:
        with open(path) as f:
            events = json.load(f)
    finally:
        for leftover in glob.glob(options.profile_file_prefix + "*"):
            os.remove(leftover)
    return _shares(events, set(job["vocab"]))


def _shares(events, vocab):
    """answers.Timed of a profile's last run (runs())."""
    found = runs(events, vocab)
    if not found:
        return answers.Timed(why="not timed: onnxruntime's profile holds no run")
    return answers.Timed(*found[-1])


def runs(events, vocab):
    """[(run seconds, head seconds)] of each model_run in the events of an onnxruntime profile, in order: the
    head's are the kernels whose op is a matmul writing vocabulary-wide rows (an output's last dim one of
    `vocab`), the rule inspect's timing and runtime.bench.prefill share."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session"
                   and e.get("name") == "model_run")
    heads = [0] * len(spans)
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        shapes = [list(s.values())[0] for s in args.get("output_type_shape", []) if s]
        if args.get("op_name") in PROFILED_MATMULS and any(s and s[-1] in vocab for s in shapes):
            for i, (start, end) in enumerate(spans):
                if start <= e["ts"] <= end:
                    heads[i] += e["dur"]
    return [((end - start) / 1e6, head / 1e6) for (start, end), head in zip(spans, heads)]
