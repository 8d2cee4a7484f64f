"""What the isolated child answers, one type per job kind (runtime.inspect.sandbox.jobs makes the jobs): the child
builds it (sandbox.work), it crosses as a JSON object (wire), and the parent makes it again with of() where the
child's result is read (isolated.Child.result), so that every reader names a field. Sizes are bytes."""
from typing import NamedTuple


class Figures(NamedTuple):
    """What sessions added to the child's memory after one run each (resident.sessions_growth): `resident_bytes`
    (RSS of one session; Pss where a folder's sessions are held together), its `anonymous_bytes` and `file_bytes`
    (mapped files) parts, `peak_bytes` the most RSS added at any moment (None where Linux does not say), and
    `kept_bytes` the free heap glibc kept until trimmed (not counted in the others)."""
    resident_bytes: int
    anonymous_bytes: int
    file_bytes: int
    peak_bytes: int | None
    kept_bytes: int


class Unrecorded(NamedTuple):
    """A layout written with prepacking off (sandbox.probed): `why` it was, and `probed` the prepacked copies
    (resident.prepacked_copies' entries) a node run alone with prepacking on made of the tables' copies."""
    why: str
    probed: list


class Optimized(NamedTuple):
    """The optimized model the child wrote (an optimize job's `out`, a measure job's or part's `layout`): whose
    folding and prepacking it is (`onnxruntime`: the version string); `data`: whether the file holds the tensor
    data (else its layout alone); `written`: whether what the parent compares is in it (a copy of a watched size
    written with its data, or told by `folded`: {copy: what constant folding made it of}, sandbox.folding);
    `owned_bytes`: what writing it held beside the session measured (resident.owned_bytes; None: not measured);
    `originals`: the original's outputs on a --retie proof's feeds saved ahead (originals.save's, or {"refused":
    why}; None: not run); `unrecorded`: an Unrecorded where written with prepacking off, else None."""
    onnxruntime: str
    data: bool
    written: bool = False
    folded: dict | None = None
    owned_bytes: int | None = None
    originals: dict | None = None
    unrecorded: Unrecorded | None = None


class Measured(NamedTuple):
    """A measure job's answer: the session's Figures, and where the job named a layout, the Optimized written
    there (else None)."""
    figures: Figures
    optimized: Optimized | None = None


class Together(NamedTuple):
    """A measure_together job's answer: the Figures (Pss) of every file's session held in one process, and where
    the parts name a layout, one Optimized per part (None for a part without one), else None."""
    figures: Figures
    layouts: list | None = None


class Proved(NamedTuple):
    """A prove job's answer: `failures` (one line each; empty: proven), or `original` (why the original itself
    does not run on the proof's feeds: nothing proven). `kept`: {"exact"} where --logits-to-keep was proven;
    `drift`: proof._drift's where weights are read in place; `heads`: agree.heads_found's; `measured`: the retied
    model's session's Figures where the job asked; `optimized`: the Optimized its layout is, where the job named
    one."""
    failures: list
    original: str | None = None
    kept: dict | None = None
    drift: dict | None = None
    heads: dict | None = None
    measured: Figures | None = None
    optimized: Optimized | None = None


class Timed(NamedTuple):
    """A prefill job's answer: `run_seconds` of the profiled run and `head_seconds` of its head's kernels, or
    `why` none was timed (the others None)."""
    run_seconds: float | None = None
    head_seconds: float | None = None
    why: str | None = None

    def entry(self):
        """The prefill entry's `timing` in --json: {"run_seconds", "head_seconds"} or {"why"}."""
        return {"why": self.why} if self.why is not None else {"run_seconds": self.run_seconds,
                                                                "head_seconds": self.head_seconds}


class RowsChecked(NamedTuple):
    """One lookup --lookup-from-head rewrote, checked for every id: its `table`, whether each row equals the head's
    dequantization bit for bit (`rows_equal_head`), else the `first_different` id (None where all do)."""
    table: str
    rows_equal_head: bool
    first_different: int | None


class Agreement(NamedTuple):
    """The greedy runs of the original and the retied model (sandbox.headrows.agreement): `prompts` run, `tokens`
    generated in all, `agreed` (tokens picked as the original did before they first differ, summed), `same_first`
    (prompts whose first token is the same), `max_logit_change` (the first step's largest |logit change|) and
    where the prompts came from (`prompts_from`)."""
    prompts: int
    tokens: int
    agreed: int
    same_first: int
    max_logit_change: float
    prompts_from: str


class LookedUp(NamedTuple):
    """A head_lookup job's answer: a RowsChecked per lookup, and the greedy runs' Agreement."""
    rows: list
    greedy: Agreement


class Against(NamedTuple):
    """The original and the retied model each measured against a float reference (sandbox.quality): the mean KL
    divergence KL(reference || model) in nats, the share of positions whose top token is the reference's, the
    reference's own perplexity, and each mean's 99th percentile."""
    kld_mean_original: float
    kld_mean_out: float
    same_top_original: float
    same_top_out: float
    ppl: float
    kld_p99_original: float
    kld_p99_out: float


class Quality(NamedTuple):
    """A quality job's answer (sandbox.quality.measure): the `tokens_scored` positions' mean KL(original || OUT) in
    nats and its 99th percentile, the share whose top token is the same, each model's perplexity on the text, an
    Against where a reference was given (else None) and the `seconds` it took; or only `why` the models could not
    be compared on the text (one line)."""
    tokens_scored: int = 0
    kld_mean: float | None = None
    kld_p99: float | None = None
    same_top: float | None = None
    ppl_original: float | None = None
    ppl_out: float | None = None
    reference: Against | None = None
    seconds: float | None = None
    why: str | None = None

    @classmethod
    def failed(cls, why):
        """The answer of models that could not be compared on the text: `why`, in one line."""
        return cls(why=why)


def wire(answer):
    """`answer` as JSON can hold it: every NamedTuple within an object of its fields."""
    if hasattr(answer, "_asdict"):
        return {name: wire(value) for name, value in answer._asdict().items()}
    if isinstance(answer, (list, tuple)):
        return [wire(value) for value in answer]
    if isinstance(answer, dict):
        return {key: wire(value) for key, value in answer.items()}
    return answer


def _made(kind, obj, **nested):
    """`kind` made again from its JSON object (None stays None), each field in `nested` by its own function."""
    if obj is None:
        return None
    return kind(**{name: nested[name](value) if name in nested and value is not None else value
                   for name, value in obj.items()})


def _figures(obj):
    return _made(Figures, obj)


def _optimized(obj):
    return _made(Optimized, obj, unrecorded=lambda u: _made(Unrecorded, u))


_MAKE = {
    "optimize": _optimized,
    "measure": lambda obj: _made(Measured, obj, figures=_figures, optimized=_optimized),
    "measure_together": lambda obj: _made(Together, obj, figures=_figures,
                                          layouts=lambda layouts: [_optimized(o) for o in layouts]),
    "prove": lambda obj: _made(Proved, obj, measured=_figures, optimized=_optimized),
    "prefill": lambda obj: _made(Timed, obj),
    "head_lookup": lambda obj: _made(LookedUp, obj, rows=lambda rows: [_made(RowsChecked, r) for r in rows],
                                     greedy=lambda greedy: _made(Agreement, greedy)),
    "quality": lambda obj: _made(Quality, obj, reference=lambda r: _made(Against, r)),
}


def of(kind, obj):
    """The answer of a job of `kind` (its "kind") made again from the JSON object `obj` the child wrote."""
    return _MAKE[kind](obj)
