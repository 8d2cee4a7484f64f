"""The retie proof: both models run on the same decoder feeds (feeds.plan's; in a folder, an input another file
makes is that file's output); heads agree within float32's bound (a float16 / bfloat16 head's, within its
format's: agree), the rest bit for bit. It runs in the isolated child (runtime.inspect.sandbox.isolated), since it
opens sessions on an untrusted model and runs onnx's shape inference on it."""
from typing import NamedTuple

import numpy as np

from runtime.model.graph.scopes import scopes
from runtime.model.read.checked import source
from runtime.model.read.model import load
from runtime.inspect.sandbox import agree, headrows
from runtime.inspect.sandbox.exposed import shown_copy
from runtime.feeds import USE_CACHE_BRANCH, NoFeeds, describe, no_past_branch, shaped_feeds, steps
from runtime.inspect.sandbox.folding import made_at_load
from runtime.inspect.sandbox.jobs import fed_of, kept_heads_of, rewritten_of
from runtime.inspect.sandbox.originals import given
from runtime.resident import resident, sessions_growth
from runtime.optimized import layout_session
from runtime.runner import Runner


def run_each(session, shown, feed_sets):
    """A generator: for each feeds of `feed_sets` in turn, every output of `session` and, by their names, the
    values `shown` ({name: the output that shows it}, exposed.with_outputs') shows. One session, run on every feed set;
    let go after the last (or when the generator is closed)."""
    names = [o.name for o in session.get_outputs()]
    for feeds in feed_sets:
        outputs = dict(zip(names, session.run(names, feeds)))
        yield {**outputs, **{name: outputs[out] for name, out in shown.items()}}


def _original(proto, folder, hidden_names, prepacking):
    """(a session of the original model, a ModelProto whose data onnxruntime reads from `folder`, with the hidden
    vectors the heads read shown as outputs; {name: output}); `prepacking`: False runs it with
    session.disable_prepacking."""
    model, shown = shown_copy(proto, hidden_names)
    # onnxruntime is the judge: contrib ops are beyond the onnx checker
    return Runner(model, data_folder=folder, prepacking=prepacking).session, shown


class OriginalFails(Exception):
    """onnxruntime cannot run the original model on the proof's feeds: nothing about the retie can be proven."""


class Proven(NamedTuple):
    """What prove() found: one-line failures (empty: proven); the retied model's measured figures or None; with
    job["keep"] {"exact": whether the last position's logits at k = 1 are the original's bit for bit}, else None;
    where job["in_place"], _drift's, else None; agree.heads_found's of the heads' outputs (k = 0), or None; whether
    the retied model's session wrote its optimized model with its data (not its layout alone: folding.made_at_load)."""
    failures: list
    figures: dict | None
    kept: dict | None
    drift: dict | None = None
    heads: dict | None = None
    written: bool = False


def prove(job):
    """Proven for a prove job (jobs.prove: before, checked (its Model's), after, rewritten: [jobs.Rewritten],
    rows, shape (feeds.plan), folder, in_place (retie.branches read the weights in place: the original is run with
    prepacking off, as its kernels then read them, and once more under the defaults for _drift), keep (retie.keep's:
    the retied model is run at k = 0, every output then the original's, and at k = 1, the logits then the
    original's last position within the head's bound, everything else bit for bit), layout (where the retied
    model's session writes its optimized model's layout, if anywhere), measure (whether to measure that session: a
    single file's retie)}; OriginalFails when the original itself does not run on those feeds. The original is read
    as checked (checked.source: its shell, each large tensor read by onnxruntime where it lies), never from a file
    swapped in since."""
    checked = source(job["checked"])
    folder = checked.folder
    before = load(job["before"], folder, data=checked.shell)  # its large tensors read where they lie: its shell
    headrows.swap_tables(before.proto, job)  # --lookup-from-head: the original looks up the head's rows
    rewritten = rewritten_of(job["rewritten"])
    flipped = {r.table: r.transposed for r in rewritten}
    tables = {name: before.tensors[name].values().T if transposed else before.tensors[name].values()
              for name, transposed in flipped.items()}  # each [vocab, width], memory-mapped
    hidden_names = sorted({r.hidden for r in rewritten if r.hidden})  # None: no head rewritten
    head_of = {r.output: (r.hidden, r.table) for r in rewritten if r.output}
    walked = list(scopes(before.proto.graph))  # the original's graphs walked once: --logits-to-keep asks twice
    chains = agree.chains(before, head_of, walked)
    watched = hidden_names + sorted(h for h in head_of if h not in {o.name for o in before.proto.graph.output})
    feed_sets = proof_feeds(job, before.proto)
    feeds_only = [f for *_, f in feed_sets]
    # one session of each model, run on every feed set in turn: one load each, one held at a time. The retied model
    # first, as it was staged, nothing shown: its session also writes its optimized model's layout (the copies it
    # holds) and, with job["measure"], is measured after its first run, in this process still fresh
    keep = job.get("keep") and {**job["keep"], "heads": kept_heads_of(job["keep"]["heads"])}
    kept_heads, nbits = _kept_heads(keep, before, tables) if keep else ({}, {})
    if keep:  # the heads that keep the last k positions: their hidden vectors shown, their tables read for a bound
        watched = sorted(set(watched) | {h.hidden for h in keep["heads"].values()} |
                         {o for o in keep["heads"] if o not in {v.name for v in before.proto.graph.output}})
    try:
        session, figures, written = _retied(job, feeds_only[0])
        if keep:  # k = 0 and k = 1 fed: the default, whichever it is, is one of them
            news = list(run_each(session, {}, [dict(f, **{keep["input"]: np.array(0, np.int64)}) for f in feeds_only]))
            lasts = list(run_each(session, {}, [dict(f, **{keep["input"]: np.array(1, np.int64)}) for f in feeds_only]))
        else:
            news = list(run_each(session, {}, feeds_only))
    except Exception:  # noqa: BLE001 - the retied model refused: unless the original is refused too (OriginalFails)
        session = None
        _originals(job, before, folder, watched, feed_sets)
        raise
    session = None  # let go before the original's opens
    olds = _originals(job, before, folder, watched, feed_sets)
    failures, every = [], {**kept_heads, **head_of}  # a retied head's bound: its table's
    all_bounds = agree.bounds(olds, every, tables)
    for (said, _), old, new, bounds in zip(feed_sets, olds, news, all_bounds):
        said += f", {keep['input']} 0" if keep else ""
        failures += [f"{said}: {f}" for f in agree.compare(old, new, head_of, chains, tables, bounds)]
    drift = _drift(before, folder, feed_sets, news, set(chains) | set(every)) if job.get("in_place") else None
    heads = agree.heads_found(olds, news, chains)
    if not keep:
        return Proven(failures, figures, None, drift, heads, written)
    every.update({out: (hidden, table) for out, (hidden, table, _) in nbits.items()})
    more, exact = _last_failures((before, walked), keep, every, nbits, tables, zip(feed_sets, olds, lasts, all_bounds))
    formats = sorted({np.dtype(old[n].dtype).name for old in olds for n in keep["outputs"] if n in old})
    return Proven(failures + more, figures, {"exact": exact, "formats": formats}, drift, heads, written)


def proof_feeds(job, proto):
    """[(what it is, feeds)]: the proof's feeds of the model `proto` for each of the plan's steps (job["shape"],
    feeds.plan; its ids' rows job["rows"]), each branch of a merged decoder, inputs another file makes made by that
    file (job["upstream"]); OriginalFails where no feeds can be made."""
    feed_sets, made = [], {}
    for past, sequence in steps(job["shape"]):
        try:
            runs = _branch_feeds(proto, job["rows"], job["shape"], sequence, past)
        except NoFeeds as e:  # the inputs cannot be made, so nothing can be run
            raise OriginalFails(f"onnxruntime cannot run the original model on the proof's feeds "
                                f"({describe(dict(job['shape'], steps=[[past, sequence]]))}): {e} (--proof-past N "
                                "sets the past length)") from None
        for branch, feeds in runs:
            for upstream in fed_of(job.get("upstream", [])):
                feeds = _fed_from(feeds, upstream, made)
            feed_sets.append((describe(dict(job["shape"], steps=[[past, sequence]])) + branch, feeds))
    made.clear()  # the other files' sessions: their outputs are fed, and are all they were for
    return feed_sets


def _kept_heads(keep, before, tables):
    """({output: (hidden, table)} of the float heads that keep the last k positions, {output: (hidden, table, how)}
    of the MatMulNBits ones, bounded against their decoded table; any other quantized head bit for bit); each float
    head's table added to `tables`, [vocab, width]."""
    kept_heads = {out: (h.hidden, h.initializer) for out, h in keep["heads"].items() if h.float_head}
    nbits = {out: (h.hidden, h.initializer, h.nbits) for out, h in keep["heads"].items() if h.nbits}
    for h in keep["heads"].values():
        if h.float_head and h.initializer not in tables:
            values = before.tensors[h.initializer].values()
            tables[h.initializer] = values if h.as_table else values.T
    return kept_heads, nbits


def _last_failures(original, keep, every, nbits, tables, runs):
    """(failures, whether the kept outputs are bit for bit) at k = 1: each of `runs` [((what, feeds), the original's
    outputs, the retied model's at k = 1, agree.bounds' entry)] against the original's last position; `original`:
    (its Model, its graphs walked: scopes')."""
    before, walked = original
    failures, last_chains, exact = [], agree.chains(before, every, walked), True
    runs = [(said, agree.last_position(old, set(keep["outputs"]) | set(every) | {h for h, _ in every.values()}),
             new, {key: b[..., -1:, :] for key, b in bounds.items()}) for (said, _), old, new, bounds in runs]
    for hidden, table, how in nbits.values():  # each table decoded once for every run
        for bounds, found in zip([b for *_, b in runs], agree.nbits_bounds(before, [old for _, old, *_ in runs],
                                                                             hidden, how)):
            if found is not None:
                bounds[hidden, table] = found
    for said, old, new, bounds in runs:
        failures += [f"{said}, {keep['input']} 1: {f}"
                     for f in agree.compare(old, new, every, last_chains, tables, bounds)]
        exact = exact and all(name in new and np.array_equal(old[name].view(np.uint8), new[name].view(np.uint8))
                              for name in keep["outputs"])
    return failures, exact


def _drift(before, folder, feed_sets, news, heads):
    """How far the retied model's outputs (`news`, one run of each of `feed_sets`), other than `heads`, lie from
    the original's run under onnxruntime's defaults, whose MatMul kernels read their own prepacked copies of the
    weights the retied model reads in place (and sum one row's products in another order than the unpacked
    kernel): {"most": the largest absolute difference (inf where NaN meets a number), "output", "at": the feed
    set, "largest": the largest |value| of that output there}, the first of the largest."""
    drift = {"most": 0.0, "output": None, "at": None, "largest": 0.0}
    runs = run_each(Runner(before.proto, data_folder=folder).session, {}, [f for _, f in feed_sets])
    for (said, _), new, old in zip(feed_sets, news, runs):
        for name in (n for n in new if n in old and n not in heads and old[n].shape == new[n].shape):
            a, b = old[name].astype(np.float64), new[name].astype(np.float64)
            gap = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))  # NaN against a number: a NaN gap
            most = float(np.max(np.nan_to_num(gap, nan=np.inf), initial=0.0))
            if most > drift["most"]:
                drift = {"most": most, "output": name, "at": said, "largest": float(np.max(np.abs(a), initial=0.0))}
    runs.close()
    return drift


def _originals(job, before, folder, watched, feed_sets):
    """The original model's outputs (and the `watched` values it shows) on each of `feed_sets`, from one session,
    or as inspect's child saved them ahead on those very feeds (originals.given: job["originals"], unless its
    weights are read in place or another file feeds it); OriginalFails where onnxruntime refuses it (then nothing
    about the retie is known)."""
    # saved ahead: the original as it is, not with the head's rows looked up (job["replaced"])
    ahead = None if job.get("in_place") or job.get("upstream") or job.get("replaced") else given(
        job.get("originals"), feed_sets, watched)
    if ahead is not None:
        return ahead
    olds, feeds_only = [], [f for *_, f in feed_sets]
    for said, _ in feed_sets:
        try:
            if not olds:  # a file whose weights the retie reads in place (retie.branches) against the export unpacked
                originals = run_each(*_original(before.proto, folder, watched, not job.get("in_place")), feeds_only)
            olds.append(outputs_of(next(originals)))
        except Exception as e:  # noqa: BLE001 - onnxruntime's refusal, whatever its type, is the finding
            raise OriginalFails(refused(said, e)) from None
    originals.close()
    return olds


WIDENING_CAST = "InsertedPrecisionFreeCast"  # onnxruntime's name for a Cast its CPU provider inserts to run a
# float16 node through a float32 kernel


def refused(said, e):
    """The line that says why onnxruntime cannot run the original model on the feeds `said` describes (`e`, its
    exception). A failure inside one of the casts the CPU provider inserted around a float16 model's nodes is a
    known limitation of that provider (onnxruntime-genai's own Generator fails there too: microsoft/onnxruntime-genai
    issue 2009), which no other past length avoids; anything else may pass at another (--proof-past)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if WIDENING_CAST not in text:
        return (f"onnxruntime cannot run the original model on the proof's feeds ({said}): {text[:300]} "
                "(--proof-past N sets the past length)")
    at = text.find("Shape mismatch")
    detail = text[at:].split(". Validate")[0] if at >= 0 else text[:200]
    return (f"onnxruntime's CPU provider cannot run this float16 model on the proof's feeds ({said}): a Cast it "
            f"inserted to run a float16 node in float32 fails ({detail}); onnxruntime-genai's Generator fails the "
            "same way on the CPU (microsoft/onnxruntime-genai issue 2009): a float16 export is for a GPU provider, "
            "and a CPU client's is float32 or int4")


def _retied(job, first):
    """(a session of the retied model at job["after"], its data beside it, under onnxruntime's defaults; what it
    added after a run on the feeds `first` (resident.session_growth's figures) where job["measure"], else None;
    whether it wrote the data). It writes its optimized model's layout to job["layout"] where the job names one,
    with the data where a tensor whose values the parent compares will be made (folding.made_at_load)."""
    data = bool(job.get("layout")) and made_at_load(job.get("sizes"))
    if job.get("measure"):
        kept = []
        figures = sessions_growth([(job["after"], None, first, job.get("layout"), data)], measure=resident, keep=kept)
        return kept[0], figures, data
    if job.get("layout"):
        return layout_session(job["after"], job["layout"], data=data), None, data
    return Runner(job["after"]).session, None, False


def _branch_feeds(model, rows, shape, sequence, past):
    """[(what, feeds)]: the proof's feeds, and for a merged decoder (a bool `use_cache_branch` input) the same with
    the branch that reads no past too, so that both branches run."""
    feeds = shaped_feeds(model, rows, shape, sequence, past=past)
    if USE_CACHE_BRANCH not in feeds or feeds[USE_CACHE_BRANCH].dtype != np.bool_:
        return [("", feeds)]
    return [(", use_cache_branch true", feeds),
            (", use_cache_branch false", no_past_branch(dict(feeds)))]


def _fed_from(feeds, upstream, made):
    """`feeds` with input upstream.input replaced by what the file that makes it gives: `upstream` (a jobs.Fed)
    names another file of the folder (the encoder whose last_hidden_state a decoder reads as
    encoder_hidden_states, the embed_tokens.onnx whose rows a split decoder reads as inputs_embeds), run as checked
    on its own feeds of the same sequence length. `made` keeps each producer's session and each output it gave (a
    merged decoder's two branches are fed the same value, one session a file)."""
    name = upstream.input
    if name not in feeds or feeds[name].ndim < 2:
        return feeds
    path, length = upstream.checked["path"], feeds[name].shape[1]
    if path not in made:
        checked = source(upstream.checked)
        folder = checked.folder
        producer = load(path, folder, data=checked.shell)
        made[path] = (producer.proto, Runner(producer.proto, data_folder=folder).session)
    proto, session = made[path]
    if (path, upstream.output, length) not in made:
        (made[path, upstream.output, length],) = session.run(
            [upstream.output], shaped_feeds(proto, upstream.rows, upstream.shape, length))
    value = made[path, upstream.output, length]
    if value.shape != feeds[name].shape or value.dtype != feeds[name].dtype:
        return feeds  # not the input it feeds, after all: the random one stays
    return dict(feeds, **{name: value})


def outputs_of(run):
    """A run's graph outputs and watched values, less the outputs that only show a watched value."""
    return {k: v for k, v in run.items() if not k.startswith("proof_shows_")}
