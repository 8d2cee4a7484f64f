"""--retie OUT for a folder: each file the client loads is planned (retie.rewrite, retie.keep) and, with the
others as they are, written into the new folder OUT, staged beside it, with one data file they share
(graphs.together: a table several files hold is stored there once, at one aligned offset every file names); each
rewritten file is proven where it lies there (retie.write.proven_at), OUT is measured again in one process holding
every session (retie.outcomes), the sidecars are copied, and only then is OUT renamed into place. A
transformers.js folder is written as transformers.js reads one (transformersjs.py): each file with data files of
its own, config.json saying so."""
import os
from typing import NamedTuple

from graphs.together import stage_together
from runtime.model.findings.across import disk_bytes
from runtime.model.read import sidecars
from runtime.model.read.layout import transformersjs_root
from runtime.model.read.text import InspectError
from runtime.inspect.retie.edits import external_sources
from runtime.inspect.retie.rewrite import borrow
from runtime.inspect.retie import lines, lossy, outcomes, quality, transformersjs
from runtime.inspect.retie import keep as keeps
from runtime.inspect.sandbox import jobs
from runtime.inspect.retie.write import Asked, Plan, planned_keeping, proven_at, proven_in_place

DATA = "model.data"  # the one data file OUT's models share


class File(NamedTuple):
    """One file of a folder as --retie writes it: its name in OUT, the result's item, its retie.write.Plan (None:
    written as it is), the sources graphs.together writes its external tensors from, and the inputs other files
    make (upstream's)."""
    name: str
    item: dict
    plan: Plan | None
    sources: dict
    fed: list


class Proven(NamedTuple):
    """What the proofs of a folder's files found: {file: {table: copies held}}, and the figures of the one file with
    a table measured by its proof (no child measures OUT again then), else None."""
    held: dict
    figures: dict | None


def retie_folder(result, out, scratch, limits, say, asked=Asked()):
    """Retie the folder `result` describes (folder.inspect_folder) into the new folder `out`; the exit status: 0
    written (or nothing to do), 1 a file's proof failed (nothing written). `asked`: write.Asked's --logits-to-keep
    (for each file whose head scores every prompt position: retie.keep) and --lookup-from-head."""
    logits_to_keep = asked.logits_to_keep
    files = planned_files(result, say, logits_to_keep, asked.lossy)
    tjs = transformersjs_root(result["folder"])  # (root, where its files lie) of a transformers.js folder, or None
    merges = not tjs and any(p["relation"] == "duplicate" for p in result["across"]["pairs"])  # one data file merges
    if not any(f.plan for f in files) and not merges:
        say(lines.NOTHING)
        return 0
    config = transformersjs.Config(tjs[0], [f.name for f in files], say) if tjs else None
    staged, said = StagedOut(files, out, config), []
    try:
        proven = proven_files(files, staged, scratch, limits, say, asked)
        if proven is None:
            return 1
        before, after = disk_bytes(result["items"]), staged.bytes()
        shared = (f", each with its own data file(s) <file>_data (transformers.js's layout{config.said()})" if tjs else
                  f" and one {staged.data} they share")
        said.append(lines.wrote_line(out, before, after, f"{len(files)} file(s){shared}"))
        outcomes.measured_again(result, staged, proven, scratch, limits, said.append)
        # the sidecars at the folder's top (config.json beside transformers.js's onnx/ too, its root's when read
        # from onnx/) and beside the files; every file keeps its name, so genai_config.json is copied naming the
        # files it named, as they resolve
        where = [os.path.dirname(f.name) for f in files]
        said += [f"retie: {line}\n" for line in sidecars.copy_into(tjs[0] if tjs else result["folder"],
                                                                     staged.root(), where,
                                                                     skip=config.names() if tjs else ())]
        staged.place(limits)
    finally:
        staged.discard()
    for line in said:
        say(line)
    return 0


class StagedOut:
    """OUT, staged beside its name from `files` (graphs.together.stage_together) when first asked for a path, and
    staged again after discard() (a proof that put a file's weights back as they were changed it)."""

    def __init__(self, files, out, config=None):
        self.out, self.config, self.staged = out, config, None
        self.models = [(f.name, (f.plan.model if f.plan else f.item["model"]).proto, f.sources) for f in files]
        self.data = data_name([name for name, _, _ in self.models])

    def root(self):
        """The staged folder, written first where it is not."""
        if self.staged is None:
            options = {"chunk_bytes": transformersjs.CHUNK_BYTES, "then": self.config.written} if self.config else {}
            try:
                self.staged = stage_together(self.models, self.out, self.data, **options)
            except ValueError as e:  # a name that would leave OUT (the layout's are checked before: never, by design)
                raise InspectError(f"--retie {self.out}: {e}; nothing written") from None
        return self.staged.staging

    def path(self, name, fresh=False):
        """Where OUT's file `name` lies while staged; `fresh`: staged again first, from the models as they are now
        (branches.in_place has just changed one)."""
        if fresh:
            self.discard()
        return os.path.join(self.root(), name)

    def written(self):
        """The names of the files written there (relative), the sidecar config.json written with them left out."""
        self.root()
        sidecar = set(self.config.names()) if self.config else set()
        return [n for n in self.staged.written if n not in sidecar]

    def bytes(self):
        """The bytes of the files written there (written())."""
        return sum(os.path.getsize(self.path(n)) for n in self.written())

    def place(self, limits):
        """Rename OUT into place; past this the deadline cuts nothing off (limits.committing)."""
        self.root()
        self.staged.place()
        limits.committing()

    def discard(self):
        if self.staged is not None:
            self.staged.discard()
            self.staged = None


def planned_files(result, say, logits_to_keep, lossy=None):
    """[File] of every file of `result`, in its order: each rewritten as retie.rewrite and retie.keep plan (its
    proto changed), a head reading another file's table pointed at it (borrow), or left as it is. A transformers.js
    folder's lookups from the head are decoded in standard ops (the browser's onnxruntime-web has no kernel for
    GatherBlockQuantized)."""
    files, place = [], outcomes.placed(result)
    if lossy is not None and transformersjs_root(result["folder"]):
        lossy = lossy._replace(decoded=True)
    borrowed, fed = _borrowed_tables(result, say), upstream(result["items"])
    keeping = _keeping(result["items"], logits_to_keep, say)
    for item in result["items"]:
        model, name = item["model"], item["file"]
        said = lambda line, name=name: say(line.replace("retie: ", f"retie: {name}: ", 1))
        rewritten, sources, keep, looked_up = planned_keeping(model, item["info"], said,
                                                              logits_to_keep if name in keeping else None,
                                                              lossy)
        for head, owner, table in borrowed.get(name, []):
            rewritten.append(borrow(model, sources, head, owner["model"], table))
        plan = Plan(model, item["info"], rewritten, sources, keep, looked_up) if rewritten or keep else None
        # as it is: its external tensors read from their files as they are written
        files.append(File(place[name], item, plan, sources if plan else external_sources(model), fed[name]))
    return files


def proven_files(files, staged, scratch, limits, say, asked=Asked()):
    """Proven: each rewritten file of `files` proven where `staged` (a StagedOut) holds it; None when a proof
    failed (said; nothing is to be written). The one file with a table in a folder of one such is measured by
    its proof. `asked`: write.Asked's (its --logits-to-keep said of each file; its records kept)."""
    logits_to_keep = asked.logits_to_keep
    held, figures = {}, None
    tabled = [f for f in files if f.item["info"].rows]  # the files measured again
    limits.progress(f"writing {staged.out} beside it, to prove its files there")
    for i, f in enumerate(files):
        if f.plan is None:
            continue
        name, (model, info, rewritten, _, keep, looked_up) = f.item["file"], f.plan
        said = lambda line, name=name: say(line.replace("retie: ", f"retie: {name}: ", 1))
        where = os.path.join(scratch, f"retie{i}")
        os.mkdir(where)
        # measured by its proof where that process is fresh: no other file's session run first for its inputs
        measure = len(tabled) == 1 and tabled[0] is f and not f.fed
        prove = lambda in_place, folder, f=f, measure=measure: proven_at(
            f.plan, staged.path(f.name, fresh=bool(in_place)), folder, limits, f.fed, in_place, measure)._replace(
            staged=staged)
        proof, weights = proven_in_place(f.plan, where, said, prove)
        held[name], failures = proof.held, proof.failures
        figures = proof.figures if measure else figures
        # a table stored anew (genai's [width, vocab] one, as "<name>_rows") counted under its old name too
        held[name].update({r.table: held[name][r.now] for r in rewritten if r.now in held[name]})
        if failures:
            say(lines.failure_line(failures[0], f"{name}: "))
            return None
        price = lossy.priced(f.plan, staged.path(f.name), where, limits, asked, name) if not f.fed else (
            {"not_measured": "its inputs are another file's outputs"} if looked_up else None)
        for line in quality.lines(price, f"{name}: ") if price else ():
            say(line)
        if rewritten:
            say(lines.rewritten_line(rewritten, model, info.shape, f"{name}: ", f.fed, weights,
                                     lossy.replaced_kind(looked_up)))
        if looked_up:
            for line in lines.lookup_lines(looked_up, info, where=f"{name}: "):
                say(line)
            if asked.records is not None:
                asked.records.extend(lossy.lookup_records(looked_up, name))
        if keep:
            say(lines.kept_line(keep, logits_to_keep, info.shape, f"{name}: ", any(r.hidden for r in rewritten)))
    return Proven(held, figures)


def _keeping(items, logits_to_keep, say):
    """The files --logits-to-keep rewrites: each whose head scores every prompt position (a decoder); the others'
    reasons said where they have a head. InspectError where no file can (nothing written)."""
    if logits_to_keep is None:
        return set()
    why = {it["file"]: keeps.why_not(it["model"], it["info"]) for it in items}
    for name, reason in why.items():
        if reason and not reason.startswith("no logits head") and any(w is None for w in why.values()):
            say(f"retie: {name}: --logits-to-keep left out: {reason}\n")
    if all(why.values()):
        reasons = [f"{name}: {reason}" for name, reason in why.items()]
        raise InspectError("--logits-to-keep: no file of the folder can keep the last positions "
                           f"({'; '.join(reasons)})")
    return {name for name, reason in why.items() if reason is None}


def data_name(files):
    """The name of the data file OUT's models share: DATA, unless a model file of that name is among `files` (a
    decoder called model.data), then the first free one of model.data.1, .2, ..."""
    taken = {os.path.basename(f) for f in files}
    return next(n for n in [DATA] + [f"{DATA}.{i}" for i in range(1, len(taken) + 2)] if n not in taken)


FED = {"encoder_hidden_states": "last_hidden_state"}  # a decoder's input -> the encoder output it is (Optimum)


def upstream(items):
    """{file: [sandbox.jobs.Fed]}: each input of a file that another file of the folder makes
    (an output of the same name, as embed_tokens.onnx makes a split decoder's inputs_embeds; or FED's), so that the
    proof feeds what the client feeds (proof._fed_from)."""
    outputs = {o.name: it for it in items for o in it["model"].proto.graph.output}
    fed = {}
    for it in items:
        fed[it["file"]] = []
        for value in it["model"].proto.graph.input:
            made = FED.get(value.name, value.name)
            maker = outputs.get(made)
            if maker is not None and maker is not it:
                fed[it["file"]].append(jobs.Fed(value.name, made, maker["model"].checked, maker["info"].rows,
                                                maker["info"].shape))
    return fed


def _borrowed_tables(result, say):
    """{file: [(head entry, the item whose file holds the table, table entry)]}: each float32 head of a token table
    in a file that looks none of that table's rows up (a split decoder beside embed_tokens.onnx), whose values are
    the table's (a duplicate, or a transposed one) but stored apart. Such a head is pointed at the table itself
    (borrow); any other is said to be left, and why."""
    borrowed = {}
    for group in result["across"]["vocabulary"]:
        if group["kind"] != "token":
            continue
        lookup = next(m for m in group["members"] if m.role == "lookup")
        owner, table = lookup.item, lookup.entry
        looked_up = {m.item["file"] for m in group["members"] if m.role == "lookup"}
        for member in group["members"]:
            item, head = member.item, member.entry
            if member.role != "head" or item["file"] in looked_up or head.initializer == table.initializer and \
                    item is owner:
                continue
            why = _why_not_borrowed(table, head)
            if why:
                say(f"retie: {owner['file']} {table.initializer} / {item['file']} {head.initializer} (a copy "
                    f"across files): left as it is ({why})\n")
            else:
                borrowed.setdefault(item["file"], []).append((head, owner, table))
    return borrowed


def _why_not_borrowed(table, head):
    if table.format != "float32" or head.format != "float32":
        fmt = head.format if head.format != "float32" else table.format
        return f"{'an' if fmt[0] in 'aeiu' else 'a'} {fmt} copy: --retie points float32 heads at another file's table"
    if not table.rows_are_tokens:
        return "the table is stored [width, vocab]"
    if head.graph != "main" and not all(
            step.endswith((".then_branch", ".else_branch")) for step in head.graph.split("/")[1:]):
        return f"read inside a Loop or Scan body ({head.graph})"
    if "Reshape" in head.views:
        return "read through a Reshape that is not the table's own shape"
    return None


