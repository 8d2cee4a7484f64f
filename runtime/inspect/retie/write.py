"""--retie: make every duplicated head read its table in a form onnxruntime keeps as one, prove it, then write."""
import os
from typing import NamedTuple

from onnx import TensorProto

from graphs.storage import stage
from runtime.bounds import NARROW, bound_words
from runtime.model.findings import counting
from runtime.model.findings.copies import copy_sizes, runtime_copies
from runtime.model.findings.counting import human, stored_copies, times
from runtime.model.findings.vocabulary import copy_key
from runtime.model.read import sidecars
from runtime.model.read.model import load
from runtime.model.read.text import InspectError
from runtime.inspect.retie import branches
from runtime.inspect.retie.keep import keep_last
from runtime.inspect.retie.rewrite import planned
from runtime.inspect.sandbox import folding, isolated, jobs, memory
from runtime.inspect.sandbox.feeds import describe
from runtime.resident import OWNED_MOST, copies_held, prepacked_copies


class Plan(NamedTuple):
    """What one file's retie is to prove: the checked Model (its proto rewritten), inspect's findings of it (`found`),
    rewrite.planned's `rewritten` and `sources`, and retie.keep.keep_last's `keep` (or None)."""
    model: object
    found: dict
    rewritten: list
    sources: dict
    keep: dict | None = None


def proven(plan, folder, limits, upstream=(), in_place=None, out=None):
    """Stage `plan`'s rewritten model (as `out` beside it, else in `folder`) and prove it there (proven_at, measured
    where `out` is given: a single file): (the graphs.storage.Staged model, proven_at's held, failures and
    figures); the caller places or discards it."""
    limits.progress(f"writing the retied model beside {out}, to prove it" if out else
                    "writing the retied model to the scratch folder, to prove it")
    # checked, like everything else, in the child; proven where it is written, and placed as it was proven
    holder = stage(plan.model.proto, out or os.path.join(folder, "retied.onnx"), sources=plan.sources)
    try:
        held, failures, measured = proven_at(plan, holder.path, folder, limits, upstream, in_place,
                                             measure=out is not None)
    except BaseException:
        holder.discard()
        raise
    return holder, held, failures, measured


def proven_at(plan, staged, folder, limits, upstream=(), in_place=None, measure=False):
    """Prove `plan`'s rewritten model, written at `staged` (isolated; `folder` the scratch folder its proof writes
    in) and count the copies a session would hold under onnxruntime's defaults: ({table now: copies held},
    failures: empty when proven, the figures of the proof's session of it under the defaults where `measure` and
    they stand, else None). InspectError when the original cannot be run on the proof's feeds (nothing about the
    retie is known). `upstream`: the inputs other files of a folder make (proof._fed_from); `in_place`: the weights
    retie.branches read in place (branches.Shared, its drift set from the proof), so the original is run with
    prepacking off and no session may prepack them; the plan's `keep` gets the proof's {"exact"} as its `kept`."""
    model, found, rewritten, _, keep = plan
    optimized = os.path.join(folder, "retied.optimized.onnx")
    finals = sorted({r.now for r in rewritten})
    # a table stored anew ("<table>_rows", not among the original's tensors) holds the table's elements
    sizes = copy_sizes(model, [{"initializer": r.now if r.now in model.tensors else r.table} for r in rewritten])
    renamed = keep["renamed"] if keep else {}  # the hidden state a head reads, as the original names it
    job = jobs.prove(jobs.Proof(
        os.path.abspath(model.path), model.checked, staged, [r._replace(hidden=renamed.get(r.hidden, r.hidden))
                                                             for r in rewritten],
        found["rows"], found["shape"], list(upstream), bool(in_place), optimized, sizes, measure,
        keep and {k: keep[k] for k in ("input", "outputs", "heads")}), folder)
    try:  # the proof's session of the retied model writes its optimized model's layout: no load of its own
        answer = isolated.call(job, "proving the retied model", limits, model.file_bytes)
        if "original" in answer:  # nothing about the retie is known: say so, and blame nothing
            raise InspectError(f"{model.path} cannot be proven on this machine, nothing written: "
                               f"{answer['original']}")
        failures = answer["failures"]
        if in_place:
            in_place.drift = answer.get("drift")
        if in_place is not None:
            in_place.heads = answer.get("heads")
        if keep is not None:
            keep["kept"] = answer.get("kept")
        if answer["data"] and not answer.get("written"):  # a tensor of a table's size made: its data to compare
            os.remove(optimized)
            isolated.call(jobs.optimize({"model": staged}, optimized, folder),
                          "optimizing the retied model", limits, model.file_bytes)
    except isolated.StepFailed as e:  # onnx or onnxruntime refusing the rewritten model: write nothing
        return {}, [f"failed, nothing written: {e}"], None
    retied, retied_optimized = load(staged), folding.read_optimized(optimized, folder, answer)
    copies = runtime_copies(retied, retied_optimized, finals)
    prepacked = prepacked_copies(retied_optimized.proto)
    packed = sorted({p["initializer"] for p in prepacked} & set(in_place.sizes if in_place else ()))
    if packed:
        failures.append(f"onnxruntime still prepacks {packed[0]}, a weight read in place")
    before = {v["table"]: v["tables_in_memory"] for v in found["vocabulary"]}
    held = {}
    for table, original in {r.now: r.table for r in rewritten}.items():
        mine = [c for c in copies if c.get("copy_of") == table and c["bytes"] >= retied.tensors[table].nbytes]
        # the CPU provider's float32 widening of a float16 / bfloat16 head's weight is held, and counted, but no
        # rewrite that keeps the table in its format removes it (verdict.why_not_widened)
        widened = [copy_key(c) for c in mine if str(c.get("view", "")).startswith("widened")]
        extra = [copy_key(c) for c in mine if copy_key(c) not in widened]
        if extra:
            failures.append(f"onnxruntime still copies {table} at run time: {extra}")
        held[table] = copies_held([table] + extra + widened, retied_optimized.proto, prepacked, prepacking=True)
        float_table = retied.tensors[table].data_type == TensorProto.FLOAT
        if held[table] > (1 if float_table else before.get(original, 1)):
            failures.append(f"under onnxruntime's default SessionOptions a session would hold {held[table]} copies "
                            f"of {table}")
    figures = answer.get("measured")  # writing the layout held what they would count: measured again
    return held, failures, figures if figures and answer["owned_bytes"] <= OWNED_MOST else None


def proven_in_place(plan, folder, say, prove):
    """A proof, a merged decoder's shared weights read in place first (branches.in_place); where that is not
    proven, the weights are left as they were and the rest proven alone. `prove(in_place, folder)` stages the
    plan's model as it is then and proves it (proven()'s): (staged, with a discard(), held, failures, figures).
    Returns (staged, held, failures, the weights read in place (branches.Shared, empty where none), figures)."""
    # --logits-to-keep alone leaves the weights as they are: its k = 0 is then the original as users run it, bit for bit
    weights, undo = (branches.in_place(plan.model, plan.found, say) if plan.rewritten else
                     (branches.Shared({}), lambda: None))
    staged, held, failures, measured = prove(weights, folder)
    if weights and failures:
        say(f"retie: the weights its branches share are left as they are (read in place: {failures[0]})\n")
        undo()
        staged.discard()
        # apart: nothing is overwritten
        weights, alone = branches.Shared({}), os.path.join(folder, "weights_as_they_were")
        os.mkdir(alone)
        staged, held, failures, measured = prove(weights, alone)
    return staged, held, failures, weights, measured


def retie(model, found, out_path, folder, limits, say, logits_to_keep=None):
    """Rewrite, prove (isolated), and only then write OUT. 0 written or nothing to do, 1 not proven.
    `logits_to_keep`: --logits-to-keep's K (retie.keep), or None."""
    rewritten, sources, keep = planned_keeping(model, found, say, logits_to_keep)
    if not rewritten and not keep:
        say("retie: nothing to do: no table is held twice in a form --retie rewrites (any left is named above)\n")
        return 0
    plan = Plan(model, found, rewritten, sources, keep)
    staged, held, failures, weights, measured = proven_in_place(
        plan, folder, say, lambda in_place, where: proven(plan, where, limits, (), in_place, out_path))
    try:
        if failures:
            say(f"retie: {failures[0]}\n" if failures[0].startswith("failed") else
                f"retie: not proven, nothing written: {failures[0]}\n")
            return 1
        if measured is None:  # what gained_line reports
            part = {"model": staged.path, "rows": found["rows"], "shape": found["shape"]}
            measured = memory.measure(part, folder, limits, model.file_bytes, settings=["defaults"])
        else:
            measured = {"defaults": measured}
        limits.progress(f"placing {out_path}")
        written = staged.place()  # the files the child checked and proved, linked into place
    finally:
        staged.discard()
    limits.committing()  # OUT is in place: what is left (these lines, the sidecars) is not cut off by the deadline
    size = sum(os.path.getsize(p) for p in written)
    if rewritten:
        say(rewritten_line(rewritten, model, found["shape"], weights=weights))
    if keep:
        say(kept_line(keep, logits_to_keep, found["shape"], retied=any(r.hidden for r in rewritten)))
    was = {v["table"]: v for v in found["vocabulary"]}
    for table, original in {r.now: r.table for r in rewritten}.items():
        say(gained_line(table, held[table], was.get(original), measured.get("defaults"),
                        stored_copies(found["pairs"], original)[0]))
    saved = model.file_bytes - size
    say(f"retie: wrote {out_path}: {human(model.file_bytes)} -> {human(size)} on disk "
        f"({f'saved {human(saved)}' if saved >= 0 else f'{human(-saved)} more'})\n")
    for line in sidecars.copy_beside(model.path, out_path):
        say(f"retie: {line}\n")
    return 0


def planned_keeping(model, found, say, logits_to_keep):
    """planned(), after retie.keep.keep_last where `logits_to_keep` is given: (rewritten, sources, keep_last's or
    None). A head's hidden input is then the Slice's output; the proof reads it by the original's name."""
    keep = None if logits_to_keep is None else keep_last(model, found, logits_to_keep)
    rewritten, sources = planned(model, found, say)
    return rewritten, sources, keep


AS_RETIED = "as the original (the retied logits within their bound)"  # k = 0, a head retied in the same run


def kept_line(keep, default, shape, where="", retied=False):
    """The line that says what --logits-to-keep added and what its proof found; `retied`: a head was retied in the
    same run (its logits then within their bound at k = 0 too)."""
    exact = (keep.get("kept") or {}).get("exact")
    nbits = any(h.nbits for h in keep["heads"].values())
    narrow = [f for f in (keep.get("kept") or {}).get("formats", []) if f in NARROW]
    last = ("bit for bit (the kernel computes each row alike)" if exact else
            "within MatMulNBits' bound at its accuracy level" if nbits else
            f"within {' and '.join(map(bound_words, narrow or ['float32']))}")
    return (f"retie: {where}{', '.join(keep['outputs'])}: input {keep['input']} (int64 scalar, default {default}) "
            f"keeps the last k positions before the head (0: all); proven on decoder feeds ({describe(shape)}): "
            f"with 0 every output {AS_RETIED if retied else 'bit for bit'}, with 1 the last position's logits {last} "
            "and every other output bit for bit\n")


def rewritten_line(rewritten, model, shape, where="", fed=(), weights=None):
    """The line that says what a proven retie of `model` rewrote and on which feeds (feeds.plan's `shape`; `fed`:
    the inputs another file made, retie_folder.upstream; `weights`: branches.in_place's, the shared weights read in
    place); `where`: the file's name and ': ', in a folder."""
    kept = ", ".join(sorted({r.now for r in rewritten}))
    heads = sum(r.hidden is not None for r in rewritten)
    lookups = len(rewritten) - heads
    changed = [f"{heads} head{'s' if heads != 1 else ''} now a Gemm on its run-time view"] if heads else []
    changed += [f"{lookups} lookup{'s' if lookups != 1 else ''} now reading the head's codes"] if lookups else []
    if weights:
        size = sum(weights.sizes.values())
        size = f"{size / 2**20:.1f} MiB" if size >= 2**20 // 10 else f"{size} bytes"
        changed.append(f"the {len(weights.sizes)} weight{'s' if len(weights.sizes) != 1 else ''} its branches share "
                       f"({size}, each prepacked once per branch before) read in place")
    merged = any(v.name == "use_cache_branch" for v in model.proto.graph.input)
    feeds = describe(shape) + (", both branches of use_cache_branch" if merged else "") + "".join(
        f", {f['input']} from {os.path.basename(f['checked']['path'])}" for f in fed)
    return (f"retie: {where}{kept} is now the one copy ({'; '.join(changed)}); proven on decoder feeds ({feeds}): "
            f"{_heads_said(getattr(weights, 'heads', None))}, every other output {_others(weights)}\n")


def _heads_said(found):
    """What the proof found of the heads' outputs (agree.heads_found's, or None), in words: within float32's bound,
    or within the bound of the narrower format they were compared in, and whether they were bit for bit there."""
    narrow = [f for f in (found or {}).get("formats", []) if f in NARROW]
    if not narrow:
        return "the logits within float32's rounding bound"
    seen = " (on these feeds bit for bit)" if found["exact"] else ""
    return f"the logits within {' and '.join(map(bound_words, narrow))}{seen}"


def _others(weights):
    """What the proof found of the outputs other than the heads: bit for bit, and where a merged decoder's weights
    are read in place, against which run of the export, and how far they lie from its run under the defaults."""
    if not weights:
        return "bit for bit"
    drift = weights.drift
    if drift is None:
        return f"bit for bit with the export's run under {counting.NO_PREPACKING}"
    if not drift["most"]:
        return f"bit for bit with the export's run under the defaults and under {counting.NO_PREPACKING}"
    # not a bound on every feed: the export's own two runs differ so, their products each within float32's bound
    return (f"bit for bit with the export's run under {counting.NO_PREPACKING}; under the defaults the export's "
            "kernels read their own packed copies and sum a row's products in another order, each product within "
            f"float32's rounding bound of the other's: its outputs lay within {drift['most']:.2g} of these on these "
            f"feeds ({drift['output']}, {drift['at']}; values up to {drift['largest']:.2g})")


def widened_note(fmt):
    """What a float16 / bfloat16 table's second copy after a retie is, to end an outcome line with."""
    return (f"; one is onnxruntime's CPU provider's float32 widening of the {fmt} head's weight, which no rewrite "
            f"that keeps the table {fmt} removes")


def gained_line(table, copies, was, figures, on_disk):
    """The outcome of a retie for `table`, in one line: its copies on disk (`on_disk`, before) and in a session under
    onnxruntime's defaults (`copies` after; the vocabulary entry `was` before) before -> after, and the bytes that
    saves; what a run adds (memory.measure's `figures`) only where the table is large enough for resident bytes to
    show it (counting.RESOLUTION), else that it is too small to; why, where the copies stay as they were."""
    counted = None if was is None else was["tables_in_memory"]
    size = 0 if was is None else was["bytes"]
    stored = f"stored {times(on_disk)} -> once" if on_disk > 1 else "stored once"
    line = (f"retie: {table}: {stored}, held {'?' if counted is None else times(counted)} -> {times(copies)} by a "
            "session under onnxruntime's defaults")
    saved = [f"{human((on_disk - 1) * size)} on disk"] if on_disk > 1 else []
    saved += [f"{human((counted - copies) * size)} in memory"] if counted is not None and counted > copies else []
    line += f"; saved {', '.join(saved)}" if saved else ""
    before = None if was is None else was["in_memory"]["defaults"].get("resident_bytes")
    after = None if figures is None else figures.get("resident_bytes")
    if size >= counting.RESOLUTION and None not in (before, after):
        line += f" (one run adds {human(after)} resident, was {human(before)})"
    elif size:
        line += f" (counted: {human(size)} is too small a table for resident bytes to show it)"
    fmt = None if was is None else was.get("format")
    if copies > 1 and fmt in NARROW:
        line += widened_note(fmt)
    elif copies == counted and copies > 1:
        line += "; the head's kernel prepacks its own copy of the codes, with or without the retie"
    return line + "\n"
