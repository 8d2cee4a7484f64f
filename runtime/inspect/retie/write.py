"""--retie: make every duplicated head read its table in a form onnxruntime keeps as one, prove it, then write."""
import os
from typing import NamedTuple

from onnx import TensorProto

from graphs.storage import stage
from runtime.model.findings.copies import copy_sizes, runtime_copies
from runtime.model.findings.counting import stored_copies
from runtime.model.findings.vocabulary import copy_key
from runtime.model.read import sidecars
from runtime.model.read.model import load
from runtime.model.read.text import InspectError
from runtime.inspect.retie import branches, lines, lossy, quality
from runtime.inspect.retie.keep import keep_last
from runtime.inspect.retie.rewrite import planned
from runtime.inspect.sandbox import folding, isolated, jobs, memory
from runtime.resident import OWNED_MOST, copies_held, prepacked_copies


class Asked(NamedTuple):
    """What --retie is asked to rewrite besides duplicated tables: --logits-to-keep's K (or None) and a rewrite that
    changes values (--lookup-from-head, --shared-int8: a rules.Lossy, or None); `records`, where given, gets
    lookup_records' entries of every file as it is proven (--json's retie record). A lossy retie's price is
    measured on `text` (--text's quality.Text, None: the default) against `reference` (--reference's path, None: a
    transformers.js folder's fp32 variant where there is one); `qualities`, where given, gets each measured file's
    quality record, with its "file"."""
    logits_to_keep: int | None = None
    lossy: object = None
    records: list | None = None
    text: object = None
    reference: str | None = None
    qualities: list | None = None


class Plan(NamedTuple):
    """What one file's retie is to prove: the checked Model (its proto rewritten), inspect's findings of it (`found`),
    rewrite.planned's `rewritten` and `sources`, retie.keep.keep_last's `keep` (or None), and `looked_up`:
    {"lookups": rewrite.planned's [headlookup.Lookup]} where --lookup-from-head rewrote any (its proof adds
    "record": lookup_proof's), else None."""
    model: object
    found: dict
    rewritten: list
    sources: dict
    keep: dict | None = None
    looked_up: dict | None = None


class Proof(NamedTuple):
    """A rewritten model proven: `staged` where it lies (graphs.storage.Staged: place() or discard(); None until the
    caller that staged it sets it), `held` {table now: the copies a session holds under onnxruntime's defaults},
    `failures` (empty: proven), `figures` the proof's session of it measured under the defaults, or None."""
    staged: object
    held: dict
    failures: list
    figures: dict | None


def proven(plan, folder, limits, upstream=(), in_place=None, out=None):
    """Stage `plan`'s rewritten model (as `out` beside it, else in `folder`) and prove it there (proven_at, measured
    where `out` is given: a single file): proven_at's Proof with its `staged`, the graphs.storage.Staged model;
    the caller places or discards it."""
    limits.progress(f"writing the retied model beside {out}, to prove it" if out else
                    "writing the retied model to the scratch folder, to prove it")
    # checked, like everything else, in the child; proven where it is written, and placed as it was proven
    holder = stage(plan.model.proto, out or os.path.join(folder, "retied.onnx"), sources=plan.sources)
    try:
        proof = proven_at(plan, holder.path, folder, limits, upstream, in_place, measure=out is not None)
    except BaseException:
        holder.discard()
        raise
    return proof._replace(staged=holder)


def proven_at(plan, staged, folder, limits, upstream=(), in_place=None, measure=False):
    """Prove `plan`'s rewritten model, written at `staged` (isolated; `folder` the scratch folder its proof writes
    in) and count the copies a session would hold under onnxruntime's defaults: a Proof, its `staged` None.
    InspectError when the original cannot be run on the proof's feeds (nothing about the retie is known).
    `upstream`: the inputs other files of a folder make (proof._fed_from); `in_place`: the weights retie.branches
    read in place (branches.Shared, its drift set from the proof), so the original is run with prepacking off and
    no session may prepack them; the plan's `keep` gets the proof's {"exact"} as its `kept`."""
    model, found, rewritten, _, keep, looked_up = plan
    refused = (found.originals or {}).get("refused")  # inspect's child ran the original on the proof's feeds
    if refused and not (in_place or upstream or looked_up):  # as the proof would: no child of the proof started
        raise InspectError(f"{model.path} cannot be proven on this machine, nothing written: {refused}")
    optimized = os.path.join(folder, "retied.optimized.onnx")
    replaced = looked_up and lossy.head_rows_of(plan, folder)
    finals = sorted({r.now for r in rewritten})
    # a table stored anew ("<table>_rows", not among the original's tensors) holds the table's elements
    sizes = copy_sizes(model, [r.now if r.now in model.tensors else r.table for r in rewritten])
    renamed = keep["renamed"] if keep else {}  # the hidden state a head reads, as the original names it
    job = jobs.prove(jobs.Proof(
        os.path.abspath(model.path), model.checked, staged, [r._replace(hidden=renamed.get(r.hidden, r.hidden))
                                                             for r in rewritten],
        found.rows, found.shape, list(upstream), bool(in_place), optimized, sizes, measure,
        keep and jobs.keeping(keep["input"], keep["outputs"], keep["heads"]), found.originals, replaced), folder)
    try:  # the proof's session of the retied model writes its optimized model's layout: no load of its own
        answer = isolated.call(job, "proving the retied model", limits, model.file_bytes)
        if answer.original is not None:  # nothing about the retie is known: say so, and blame nothing
            raise InspectError(f"{model.path} cannot be proven on this machine, nothing written: {answer.original}")
        failures, written = answer.failures, answer.optimized
        if in_place:
            in_place.drift = answer.drift
        if in_place is not None:
            in_place.heads = answer.heads
        if keep is not None:
            keep["kept"] = answer.kept
        if written.data and not written.written:  # a tensor of a table's size made: its data to compare
            os.remove(optimized)
            isolated.call(jobs.optimize(jobs.tool_model(staged), optimized, folder),
                          "optimizing the retied model", limits, model.file_bytes)
        if looked_up and not failures:
            failures += lossy.lookup_proof(plan, staged, replaced, folder, limits)
    except isolated.StepFailed as e:  # onnx or onnxruntime refusing the rewritten model: write nothing
        return Proof(None, {}, [f"failed, nothing written: {e}"], None)
    retied, retied_optimized = load(staged), folding.read_optimized(optimized, folder, written)
    copies = runtime_copies(retied, retied_optimized, finals, written.folded)
    prepacked = prepacked_copies(retied_optimized.proto)
    packed = sorted({p["initializer"] for p in prepacked} & set(in_place.sizes if in_place else ()))
    if packed:
        failures.append(f"onnxruntime still prepacks {packed[0]}, a weight read in place")
    held = _held(plan, retied, retied_optimized, (copies, prepacked), failures)
    figures = answer.measured  # writing the layout held what they would count: measured again
    return Proof(None, held, failures,
                 figures._asdict() if figures is not None and written.owned_bytes <= OWNED_MOST else None)


def _held(plan, retied, retied_optimized, copies, failures):
    """{table now: the copies a session of the retied model holds under the defaults} (`copies`: runtime_copies'
    and prepacked_copies' of its optimized model), a failure added where onnxruntime still copies a table, or a
    session holds more copies than it should: one of a float32 table, as many as before of another, and of head
    codes --lookup-from-head's lookup now reads, one and the head kernel's prepacked ones (as before)."""
    (copies, prepacked), looked_up = copies, plan.looked_up
    before = {v["table"]: v["tables_in_memory"] for v in plan.found.vocabulary}
    held = {}
    for table, original in {r.now: r.table for r in plan.rewritten}.items():
        mine = [c for c in copies if c.get("copy_of") == table and c["bytes"] >= retied.tensors[table].nbytes]
        # the CPU provider's float32 widening of a float16 / bfloat16 head's weight is held, and counted, but no
        # rewrite that keeps the table in its format removes it (verdict.why_not_widened)
        widened = [copy_key(c) for c in mine if str(c.get("view", "")).startswith("widened")]
        extra = [copy_key(c) for c in mine if copy_key(c) not in widened]
        if extra:
            failures.append(f"onnxruntime still copies {table} at run time: {extra}")
        held[table] = copies_held([table] + extra + widened, retied_optimized.proto, prepacked, prepacking=True)
        float_table = retied.tensors[table].data_type == TensorProto.FLOAT
        codes = looked_up and any(k.codes == table for k in looked_up["lookups"])
        most = 1 + packs(table, prepacked) if codes else 1 if float_table else before.get(original, 1)
        if held[table] > most:
            failures.append(f"under onnxruntime's default SessionOptions a session would hold {held[table]} copies "
                            f"of {table}")
    return held


def packs(name, prepacked):
    """How many prepacked copies of initializer `name` a kernel holds (resident.prepacked_copies' list)."""
    return sum(p["initializer"] == name for p in prepacked)


def proven_in_place(plan, folder, say, prove):
    """A proof, a merged decoder's shared weights read in place first (branches.in_place); where that is not
    proven, the weights are left as they were and the rest proven alone. `prove(in_place, folder)` stages the
    plan's model as it is then and proves it (proven()'s Proof). Returns (that Proof, the weights read in place:
    branches.Shared, empty where none)."""
    # --logits-to-keep alone leaves the weights as they are: its k = 0 is then the original as users run it, bit for bit
    weights, undo = (branches.in_place(plan.model, plan.found, say) if plan.rewritten else
                     (branches.Shared({}), lambda: None))
    proof = prove(weights, folder)
    if weights and proof.failures:
        say(f"retie: the weights its branches share are left as they are (read in place: {proof.failures[0]})\n")
        undo()
        proof.staged.discard()
        # apart: nothing is overwritten
        weights, alone = branches.Shared({}), os.path.join(folder, "weights_as_they_were")
        os.mkdir(alone)
        proof = prove(weights, alone)
    return proof, weights


def retie(model, found, out_path, folder, limits, say, asked=Asked()):
    """Rewrite, prove (isolated), and only then write OUT. 0 written or nothing to do, 1 not proven. `asked`: the
    rewrites asked for besides ties (--logits-to-keep, retie.keep; --lookup-from-head, retie.headlookup)."""
    logits_to_keep = asked.logits_to_keep
    rewritten, sources, keep, looked_up = planned_keeping(model, found, say, logits_to_keep, asked.lossy)
    if not rewritten and not keep:
        say(lines.NOTHING)
        return 0
    plan = Plan(model, found, rewritten, sources, keep, looked_up)
    proof, weights = proven_in_place(
        plan, folder, say, lambda in_place, where: proven(plan, where, limits, (), in_place, out_path))
    staged, held, failures, measured = proof.staged, proof.held, proof.failures, proof.figures
    try:
        if failures:
            say(lines.failure_line(failures[0]))
            return 1
        price = lossy.priced(plan, staged.path, folder, limits, asked, model.path)
        if measured is None:  # what gained_line reports
            part = jobs.part(jobs.tool_model(staged.path), found.rows, found.shape)
            measured = memory.measure(part, folder, limits, model.file_bytes, settings=["defaults"])
        else:
            measured = {"defaults": measured}
        limits.progress(f"placing {out_path}")
        written = staged.place()  # the files the child checked and proved, linked into place
    finally:
        staged.discard()
    limits.committing()  # OUT is in place: what is left (these lines, the sidecars) is not cut off by the deadline
    size = sum(os.path.getsize(p) for p in written)
    for line in quality.lines(price) if price else ():
        say(line)
    if rewritten:
        say(lines.rewritten_line(rewritten, model, found.shape, weights=weights,
                                 replaced=lossy.replaced_kind(looked_up)))
    if looked_up:
        for line in lines.lookup_lines(looked_up, found, measured):
            say(line)
        if asked.records is not None:
            asked.records.extend(lossy.lookup_records(looked_up, model.path))
    if keep:
        say(lines.kept_line(keep, logits_to_keep, found.shape, retied=any(r.hidden for r in rewritten)))
    was = {v["table"]: v for v in found.vocabulary}
    for table, original in {r.now: r.table for r in rewritten if r.table not in (looked_up or {}).get(
            "changes", {})}.items():
        say(lines.gained_line(table, held[table], was.get(original), measured.get("defaults"),
                              stored_copies(found.pairs, original)[0]))
    say(lines.wrote_line(out_path, model.file_bytes, size))
    for line in sidecars.copy_beside(model.path, out_path):
        say(f"retie: {line}\n")
    return 0


def planned_keeping(model, found, say, logits_to_keep, lossy=None):
    """planned(), after retie.keep.keep_last where `logits_to_keep` is given: (rewritten, sources, keep_last's or
    None, Plan's looked_up or None). A head's hidden input is then the Slice's output; the proof reads it by the
    original's name."""
    keep = None if logits_to_keep is None else keep_last(model, found, logits_to_keep)
    rewritten, sources, lookups = planned(model, found, say, lossy)
    return rewritten, sources, keep, {"lookups": lookups} if lookups else None


