"""The jobs the isolated child runs (runtime.inspect.sandbox.child), each made by one constructor here, and the
typed records that cross the process boundary with them.

A job is a JSON object: what the parent writes is what the child reads, so each kind's fields are named once, in
its constructor, and so are its pieces: a model's source (user_model, tool_model) and a file to measure (part). A
record (a NamedTuple) is written as a JSON list and made again in the child with `of(...)`. What the child answers
is sandbox.answers'.
"""
from typing import NamedTuple


class Rewritten(NamedTuple):
    """One head (or lookup) --retie rewrote: the head's output and the hidden input it multiplies (None for a
    lookup that now reads the head's codes), the table as the original stores it, whether stored transposed there,
    and the name of the one tensor that holds it now."""
    output: str | None
    hidden: str | None
    table: str
    transposed: bool
    now: str


class KeptHead(NamedTuple):
    """A logits head --logits-to-keep slices before: the hidden state as the original names it, the head's
    initializer, whether that is stored [vocab, width], whether the head is a float head (bounded against its
    table), and for a MatMulNBits head what its bound needs (retie.keep._nbits), else None."""
    hidden: str
    initializer: str
    as_table: bool
    float_head: bool
    nbits: dict | None


class Fed(NamedTuple):
    """An input of a folder's file that another file of it makes (retie.folder.upstream), which a --retie's proof
    feeds as the client does (proof._fed_from): the `input`, the maker's `output` that it is, and the maker as
    checked (its Model's `checked`) with its feeds' `rows` and `shape` (feeds.plan)."""
    input: str
    output: str
    checked: dict
    rows: dict
    shape: dict


def fed_of(entries):
    """[Fed] from a job's JSON lists."""
    return [Fed(*e) for e in entries]


def user_model(checked):
    """The source of a job on the user's model: its Model's `checked` (read.checked.source opens what was checked)."""
    return {"checked": checked}


def tool_model(path):
    """The source of a job on a model this tool wrote, at `path` in its scratch folder (a retied model)."""
    return {"model": path}


def source_of(part):
    """The source (user_model's or tool_model's) a part was made with."""
    return {k: part[k] for k in ("checked", "model") if k in part}


def part(source, rows, shape, layout=None, sizes=None):
    """A model to measure (memory.measure) or a file of a folder's measure_together job: its `source`, and the
    decoder feeds `rows` and `shape` (feeds.plan) describe; with `layout`, its session also writes its optimized
    model's layout there (`sizes` as optimize's)."""
    found = {**source, "rows": rows, "shape": shape}
    return found if layout is None else {**found, "layout": layout, "sizes": sizes}


def rewritten_of(entries):
    """[Rewritten] from a job's JSON lists."""
    return [Rewritten(*e) for e in entries]


def kept_heads_of(heads):
    """{output: KeptHead} from a job's JSON lists."""
    return {out: KeptHead(*h) for out, h in heads.items()}


def optimize(source, out, folder, sizes=None):
    """Build onnxruntime's optimized model of `source` (user_model's for the user's file, tool_model's for one this
    tool wrote) at `out`; `sizes`: the element counts whose copies are looked for
    (only the layout is written unless the optimizer makes a tensor of one of them), None: the data too."""
    return {"kind": "optimize", **source, "out": out, "folder": folder, "sizes": sizes}


def measure(source, folder, rows, shape, prepacking=True, layout=None, sizes=None):
    """Measure what a session of `source` (as optimize's) adds after one run on the decoder feeds `rows` and
    `shape` (feeds.plan) describe, with prepacking on or off; with `layout`, the session also writes its optimized
    model's layout there (and `sizes` says, as optimize's, when the data must be written too)."""
    job = {"kind": "measure", **source, "folder": folder, "rows": rows, "shape": shape, "prepacking": prepacking}
    return job if layout is None else {**job, "layout": layout, "sizes": sizes}


def proving(job, show, out):
    """A measure job (or a measure_together part) whose layout, where a session of its own writes it once the one
    measured is let go, also gives a --retie's proof the original's outputs: that session shows `show` (the heads'
    hidden vectors and products) and runs the proof's feeds, saved at `out` (sandbox.originals.save)."""
    return {**job, "proving": {"show": show, "out": out}}


def measure_together(parts, folder, prepacking):
    """Measure every file of a folder in one process (Pss): `parts` [part()], each with a layout or none."""
    return {"kind": "measure_together", "files": parts, "folder": folder, "prepacking": prepacking}


def prefill(checked, folder, rows, shape, tokens, vocab):
    """Time one profiled prefill of `tokens` prompt tokens of the checked model (sandbox.timing); `vocab`: the
    logits heads' vocabulary sizes."""
    return {"kind": "prefill", "checked": checked, "folder": folder, "rows": rows, "shape": shape, "tokens": tokens,
            "vocab": vocab}


class Proof(NamedTuple):
    """What a prove job proves: the original (its path, its Model's checked), the staged retied model `after`, the
    [Rewritten] heads, the feeds' rows and shape, and how: `upstream` ([Fed]: the inputs other files of a folder
    make), `in_place` (weights read in place: the original is run with prepacking off), `layout` (where the retied
    model's session writes its optimized model's layout) with `sizes`, `measure` (measure that session), `keep`
    (keeping's, or None), and `originals`: the original's outputs on the proof's feeds as inspect's child saved
    them ahead (sandbox.originals.save's, an answers.Optimized's), or None; `replaced`: {float table: head_rows()}
    the original reads the head's rows instead of (--lookup-from-head), or None."""
    before: str
    checked: dict
    after: str
    rewritten: list
    rows: dict
    shape: dict
    upstream: list = []
    in_place: bool = False
    layout: str | None = None
    sizes: list | None = None
    measure: bool = False
    keep: dict | None = None
    originals: dict | None = None
    replaced: dict | None = None


def keeping(input, outputs, heads):
    """Proof.keep: --logits-to-keep's scalar `input`, the logits `outputs` it slices, and {output: KeptHead}."""
    return {"input": input, "outputs": outputs, "heads": heads}


def head_rows(rows, transposed, head=None):
    """An entry of Proof.replaced: the head's rows as a float table (.npy at `rows`, [vocab, width]), whether the
    table they stand in for is stored transposed, and where --shared-int8 made the head's codes anew, requantized()'s
    (else None)."""
    return {"rows": rows, "transposed": transposed, "head": head}


def requantized(output, names, arrays, attributes):
    """A MatMulNBits head --shared-int8 requantized, for the original to run as OUT does (headrows.swap_tables): the
    head node by its `output`, the new codes' and scales' initializer `names` with their .npy `arrays`, and the
    `attributes` it now has (bits, block_size); its zero points dropped."""
    return {"output": output, "names": names, "arrays": arrays, "attributes": attributes}


def lookup_check(output, table, rows):
    """A lookup of head_lookup's: its `output` in the retied model, the float `table` it read before, and the
    head's rows (.npy at `rows`) it must give for every id."""
    return {"output": output, "table": table, "rows": rows}


def greedy_feeds(rows, shape, prompts):
    """head_lookup's `feeds`: the decoder feeds' `rows` and `shape` (feeds.plan) and the greedy runs' `prompts`
    (ids; None: fixed ones)."""
    return {"rows": rows, "shape": shape, "prompts": prompts}


def head_lookup(checked, after, lookups, feeds, logits, vocab, folder):
    """Check the lookups --lookup-from-head rewrote in the retied model `after` ([lookup_check]) against the head's
    rows for every id, and run it and the original (its Model's `checked`) greedily (sandbox.headrows): `logits`
    names the logits output, `vocab` bounds the ids fed; `feeds`: greedy_feeds' (the prompts:
    retie.headlookup.prompts_for's)."""
    return {"kind": "head_lookup", "checked": checked, "after": after, "lookups": lookups, **feeds,
            "logits": logits, "vocab": vocab, "folder": folder}


def scored(source, ids, logits, rows, shape):
    """One model a quality job runs: its source (user_model, tool_model), its token ids input, its logits output,
    and its feeds' rows and plan (runtime.feeds.plan)."""
    return {**source, "ids": ids, "logits": logits, "rows": rows, "shape": shape}


def quality(original, out, reference, windows, folder):
    """Run the original, the retied model and a float reference (each scored(); the reference may be None)
    teacher-forced over `windows` (lists of token ids, each from an empty past) and compare their next-token
    distributions (sandbox.quality)."""
    return {"kind": "quality", "original": original, "out": out, "reference": reference, "windows": windows,
            "folder": folder}


def prove(proof, folder):
    """The prove job for `proof` (a Proof), its scratch files in `folder`."""
    return {"kind": "prove", "folder": folder, **proof._asdict()}
