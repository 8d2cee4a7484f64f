"""What a lossy retie costs the model, in the field's own measures: the original and OUT (and a float reference,
where one is at hand) run teacher-forced over a text in the isolated child (sandbox.quality), and the mean KL
divergence, its 99th percentile, the share of positions with the same top token and each perplexity said.

The text is cut here, in the parent: its tokens (the model's tokenizer.json) in non-overlapping windows of WINDOW
tokens (or the model's context where smaller), each opened by the special tokens the tokenizer puts at a text's
start, until SCORED positions are scored (every position after a window's first). docs/retie.md, "What a lossy
retie costs", gives the method in full."""
import codecs
import math
import os
import stat
from typing import NamedTuple

from runtime.model.found import static_findings
from runtime.model.read.layout import client_files, tokenizer_of, transformersjs_root
from runtime.model.read.model import load
from runtime.model.read.text import InspectError
from runtime.inspect.retie.transformersjs import session
from runtime.inspect.sandbox import isolated, jobs
from runtime import feeds

DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lab_text.txt")
DEFAULT_NAME = "the lab's own text"  # seven short pieces of everyday English prose written for the project
WINDOW, SCORED = 512, 4096
TEXT_MOST = 16 * 2**20  # the characters of a --text tokenized at most: far past what SCORED tokens need
_READ = 1 << 16


class Text(NamedTuple):
    """The text a lossy retie is measured on: its `path` and how the report names it."""
    path: str
    name: str


DEFAULT = Text(DEFAULT_TEXT, DEFAULT_NAME)


def checked_text(path):
    """--text's file, checked before anything is written: a Text, or InspectError in one line where it is missing,
    not a regular file (a folder, a FIFO: opened without waiting, refused on its descriptor), empty, or not UTF-8."""
    decoder, at = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb", buffering=0) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise InspectError(f"--text {path}: not a regular file (a folder, FIFO or device); give a UTF-8 "
                                   "text file")
            while block := f.read(1 << 20):
                decoder.decode(block)
                at += len(block)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise InspectError(f"--text {path}: not UTF-8 (byte {at + e.start}); give a UTF-8 text file") from None
    except OSError as e:
        raise InspectError(f"--text {path}: {e.strerror}") from None
    if at == 0:
        raise InspectError(f"--text {path}: empty; give a file holding text")
    return Text(path, path)


def _pieces(path):
    """The text's characters in growing pieces, each cut after its last newline (or space) so that no word is
    split: what has been read so far, as one string, at each step; at most TEXT_MOST characters."""
    with open(path, encoding="utf-8") as f:
        held, size = "", _READ
        while True:
            block = f.read(size)
            if not block:
                yield held
                return
            held += block
            if len(held) >= TEXT_MOST:
                yield held[:TEXT_MOST]
                return
            cut = max(held.rfind("\n"), held.rfind(" ")) + 1
            if cut:
                yield held[:cut]
            size *= 2


def opening(tokenizer):
    """The ids the tokenizer puts before a text's own (a BOS token, say), as its post-processor adds them."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    return full[:at]


def windows(tokenizer, text, window, scored=SCORED):
    """[[token ids]]: the text's tokens in non-overlapping windows of `window` ids (the opening() ids first in each),
    until `scored` positions (each window's length less one) are scored, or the text ends (its last window shorter);
    InspectError where no window of two ids can be made."""
    start = opening(tokenizer)
    step = window - len(start)
    if step < 1:
        raise InspectError(f"the model's context ({window}) holds no token after the tokenizer's opening ids")
    needed = math.ceil(scored / (window - 1)) * step
    ids = []
    for piece in _pieces(text.path):
        ids = tokenizer.encode(piece, add_special_tokens=False).ids
        if len(ids) >= needed:
            break
    found, count = [], 0
    for at in range(0, len(ids), step):
        chunk = start + ids[at:at + step]
        if len(chunk) < 2 or count >= scored:
            break
        found.append(chunk)
        count += len(chunk) - 1
    if not found:
        raise InspectError(f"{text.name}: no two tokens to score in it")
    return found


def reference_for(model_path, given=None):
    """The float model to measure against: `given` (--reference, a file, or a folder: its transformers.js fp32
    variant's file of the same session, else the file of the model's own name in it), else, for a file of a
    transformers.js folder's onnx/, its fp32 variant (model_q4.onnx -> model.onnx); None where there is none. A
    --reference that names no model file: InspectError."""
    name = os.path.basename(model_path)
    fp32 = session(name) + ".onnx"
    if given is not None:
        if not os.path.isdir(given):
            return given
        if transformersjs_root(given) is not None:
            files = [os.path.join(given, f) for f in client_files(given, dtype="fp32")[0]]
            chosen = next((f for f in files if os.path.basename(f) == fp32), files[0] if len(files) == 1 else None)
        else:
            chosen = next((os.path.join(given, f) for f in (name, fp32) if os.path.isfile(os.path.join(given, f))),
                          None)
        if chosen is None:
            raise InspectError(f"--reference {given}: no {fp32} or {name} in it to measure against")
        return chosen
    folder = os.path.dirname(os.path.abspath(model_path))
    if os.path.basename(folder) != "onnx" or transformersjs_root(folder) is None or fp32 == name:
        return None
    path = os.path.join(folder, fp32)
    return path if os.path.isfile(path) else None


def _ids_input(proto, rows):
    """The model's token ids input: `input_ids` where it has one, else the one integer input a lookup reads whose
    name says nothing of positions; None where neither is."""
    names = [v.name for v in proto.graph.input]
    if "input_ids" in names:
        return "input_ids"
    found = [n for n in names if n in rows and "position" not in n]
    return found[0] if len(found) == 1 else None


def window_of(found):
    """The tokens a window holds: WINDOW, or fewer where the model's declared context or a position table's rows
    (GPT-2's learned positions) end sooner."""
    bounds = [(found.shape or {}).get("context")] + [rows for name, rows in found.rows.items() if "position" in name]
    return min([WINDOW] + [b for b in bounds if b])


def _logits(found):
    """The output a model's head scores into: its first head's, else `logits`."""
    return next((h.scores for h in found.heads if h.scores), "logits")


class Measure(NamedTuple):
    """What a quality job needs besides the retied model: the original's token ids input and logits output (OUT's
    the same), the text's windows and how they were cut, and the reference (its path, the job's entry for it and
    its files' bytes), or None."""
    ids: str
    logits: str
    windows: list
    window: int
    text: Text
    reference: str | None
    reference_job: dict | None
    reference_bytes: int = 0


def prepared(model, found, text=None, reference=None):
    """A Measure for `model` (its Findings `found`), or (None, why) where it cannot be measured: no tokenizer.json
    beside the model (or above a transformers.js onnx/ folder), or no token ids input. `reference`: --reference's
    path, else the transformers.js fp32 sibling where there is one."""
    tokenizer = tokenizer_of(model.path)
    if tokenizer is None:
        return None, "no tokenizer.json beside the model (and the tokenizers library) to make its tokens"
    ids = _ids_input(model.proto, found.rows)
    if ids is None:
        return None, "no token ids input found to feed the text through"
    window = window_of(found)
    text = text or DEFAULT
    cut = windows(tokenizer, text, window)
    path = reference_for(model.path, reference)
    if path is None or os.path.realpath(path) == os.path.realpath(model.path):
        return Measure(ids, _logits(found), cut, window, text, None, None), None
    ref = load(path)  # the checked reader: its child opens the file checked here
    ref_found = static_findings(ref, feeds.plan(ref.proto, path))
    ref_ids = _ids_input(ref.proto, ref_found.rows)
    if ref_ids is None:
        raise InspectError(f"--reference {path}: no token ids input found in it")
    ref_job = jobs.scored(jobs.user_model(ref.checked), ref_ids, _logits(ref_found), ref_found.rows,
                          ref_found.shape)
    return Measure(ids, _logits(found), cut, window, text, path, ref_job, ref.file_bytes), None


def measure(model, found, staged, folder, limits, text=None, reference=None):
    """The quality record of OUT (staged at `staged`) against `model`, the original (Findings `found`): record(),
    or {"not_measured": why} where it cannot be measured."""
    ready, why = prepared(model, found, text, reference)
    if ready is None:
        return {"not_measured": why}
    ids, logits = ready.ids, ready.logits
    job = jobs.quality(jobs.scored(jobs.user_model(model.checked), ids, logits, found.rows, found.shape),
                       jobs.scored(jobs.tool_model(staged), ids, logits, found.rows, found.shape),
                       ready.reference_job, ready.windows, folder)
    limits.progress(f"measuring the retie's price on {sum(len(w) - 1 for w in ready.windows)} tokens")
    weight = 2 * model.file_bytes + ready.reference_bytes
    try:
        answer = isolated.call(job, "measuring the retie's price on a text", limits, weight)
    except isolated.StepFailed as e:
        return {"not_measured": f"the models did not run on the text ({str(e)[:200]})"}
    if answer.why is not None:
        return {"not_measured": answer.why}
    return record(answer, ready)


def record(answer, ready):
    """--json's `quality` record of an answers.Quality measured on `ready` (a Measure)."""
    ref = answer.reference
    return {"text": ready.text.name, "tokens_scored": answer.tokens_scored, "window": ready.window,
            "kld_mean": answer.kld_mean, "kld_p99": answer.kld_p99, "same_top": answer.same_top,
            "ppl_original": answer.ppl_original, "ppl_out": answer.ppl_out,
            "reference": None if ref is None else {
                "model": ready.reference, "kld_mean_original": ref.kld_mean_original,
                "kld_mean_out": ref.kld_mean_out, "same_top_original": ref.same_top_original,
                "same_top_out": ref.same_top_out, "ppl": ref.ppl},
            "windows": len(ready.windows), "seconds": answer.seconds}


def lines(quality, where=""):
    """The (at most two) lines that lead a lossy retie's: its price against the original, and against the float
    reference where one was measured; one line saying why where it was not measured."""
    if "not_measured" in quality:
        return [f"retie: {where}its price on the model's choices was not measured: {quality['not_measured']}\n"]
    q, ref = quality, quality["reference"]
    short = f" (all it has: fewer than the {SCORED} asked)" if q["tokens_scored"] < SCORED else ""
    said = [f"retie: {where}its price, teacher-forced on {q['tokens_scored']} tokens of {q['text']}{short} "
            f"({q['windows']} windows of {q['window']}): KL(original || OUT) mean {q['kld_mean']:.3g} nats, 99th "
            f"percentile {q['kld_p99']:.3g}; the same top token at {100 * q['same_top']:.1f}% of positions; perplexity "
            f"{q['ppl_original']:.2f} -> {q['ppl_out']:.2f}\n"]
    if ref is not None:
        closer = ref["kld_mean_out"] - ref["kld_mean_original"]
        verdict = "closer to" if closer < 0 else "farther from" if closer > 0 else "as far from"
        said.append(f"retie: {where}against the float model {ref['model']} (perplexity {ref['ppl']:.2f}): KL mean "
                    f"{ref['kld_mean_original']:.3g} nats from the original, {ref['kld_mean_out']:.3g} from OUT; the "
                    f"same top token {100 * ref['same_top_original']:.1f}% -> {100 * ref['same_top_out']:.1f}%: OUT "
                    f"is {verdict} it" + (f" by {abs(closer):.3g} nats\n" if closer else "\n"))
    return said
