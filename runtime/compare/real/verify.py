"""--verify-under-trained N: the indicator's top candidates put to the model itself, as Land & Bartolo verify them.
A prompt shows the model a few times that a token is to be copied, then asks it to copy the candidate: a token the
model learned, it copies with high probability; a row training never reached gives the token next to none. The
model runs in onnxruntime from an empty past, the whole sequence again at each greedy step (no cache: any decoder
layout runs the same way)."""
import numpy as np
import onnxruntime as ort

from runtime.feeds import NoFeeds, no_past_branch, plan, shaped_feeds
from runtime.model.read import paths
from runtime.model.read.checked import source
from runtime.model.read.model import load
from runtime.runner import read_data_from

PREAMBLE = "A copying machine prints back exactly the word it is given, every time."
GIVEN, PRINTED, CLOSE = "\nGiven: «", "»\nPrinted: «", "»"
SHOTS = 4  # worked copies of the candidate before the one asked for
STEPS = 3  # greedy steps: the token may come after a space or a quote the model adds first
CONFIRMS = 0.01  # the largest probability of the token in those steps under this confirms it
IDS, LOGITS = "input_ids", "logits"


def prompt_text():
    """The prompt, the candidate shown as {token}."""
    shot = f"{GIVEN}{{token}}{PRINTED}{{token}}{CLOSE}"
    return PREAMBLE + shot * SHOTS + f"{GIVEN}{{token}}{PRINTED}"


def prompt_ids(encode, token_id):
    """The prompt's ids with `token_id` at every place the candidate stands (the token itself, whatever text the
    tokenizer would make of its string); `encode` the tokenizer's text -> ids, no special tokens added."""
    given, printed, close = encode(GIVEN), encode(PRINTED), encode(CLOSE)
    shot = given + [token_id] + printed + [token_id] + close
    return encode(PREAMBLE) + shot * SHOTS + given + [token_id] + printed


def _checked(table):
    """The table's ONNX model read again by the checked reader: its shell (large tensors left where they lie, never
    parsed into a protobuf: Gemma 3's inline 1.74 GB file), its external data inside its folder."""
    path, root = paths.model_path(table.model)
    return load(path, root=root)


def why_not(table, vocabulary):
    """(why the candidates cannot be run, one line, or None; the checked model where they can): a GGUF file
    (onnxruntime runs ONNX), no tokenizer to write the prompt, or a model file without `input_ids` in and `logits`
    out."""
    if table.tokens is not None:
        return "a GGUF file: onnxruntime runs ONNX models; verify on the model's ONNX export", None
    if vocabulary.encode("") is None:
        return "no tokenizer to write the prompt (tokenizer.json beside the model, and the tokenizers library)", None
    checked = _checked(table)
    names = {v.name for v in checked.proto.graph.input}, {v.name for v in checked.proto.graph.output}
    if IDS not in names[0] or LOGITS not in names[1]:
        return f"{table.model} is not a decoder with an {IDS} input and a {LOGITS} output", None
    return None, checked


def _probabilities(session, model, shape, ids, token_id, vocab):
    """The largest probability of `token_id` over STEPS greedy steps after `ids`."""
    tokens, most = list(ids), 0.0
    for _ in range(STEPS):
        feeds = shaped_feeds(model, {IDS: vocab}, shape, len(tokens), past=0)  # NoFeeds: one line, never a traceback
        feeds[IDS] = np.array([tokens], dtype=feeds[IDS].dtype)
        no_past_branch(feeds)
        (logits,) = session.run([LOGITS], feeds)
        last = logits.reshape(-1, logits.shape[-1])[-1].astype(np.float64)
        last = np.exp(last - last.max())
        most = max(most, float(last[token_id] / last.sum()))
        tokens.append(int(np.argmax(last)))
    return most


def verify(table, vocabulary, candidates, count, controls=()):
    """{"checked", "confirmed", "threshold", "prompt", "tokens": [{"id", "token", "probability"}], "controls": [the
    same]} of the first `count` candidates ({"id", ...} best first) and of the `controls` ids (tokens the model
    surely learned, the queries: asked the same way, they show the test can fail), the model run under
    onnxruntime's default session options; or {"checked": 0, "confirmed": 0, "why": line} where it cannot run."""
    why, checked = why_not(table, vocabulary) if candidates else ("no candidates to put to the model (the indicator "
                                                                   "found none)", None)
    if why is None:
        model = checked.proto
        try:
            held = source(checked.checked)  # the file onnxruntime opens is the one checked, by its descriptor
            try:
                opened, folder = held.as_user()
                session = ort.InferenceSession(opened, read_data_from(ort.SessionOptions(), folder),
                                               providers=["CPUExecutionProvider"])
            finally:
                held.close()
            shape = plan(model, table.model)
            asked = lambda token_id: round(_probabilities(session, model, shape, prompt_ids(vocabulary.encode,
                                                                                           token_id),
                                                          token_id, table.vocab), 6)
            found = [{"id": c["id"], "token": c["token"], "probability": asked(c["id"])} for c in candidates[:count]]
            checked = [{"id": t, "token": vocabulary.token(t), "probability": asked(t)} for t in controls]
        except NoFeeds as e:
            why = f"the model did not run: {e}"
        except Exception as e:  # noqa: BLE001 - onnxruntime's errors share no base class (Fail, InvalidArgument...)
            why = f"the model did not run: {str(e).splitlines()[0][:200] if str(e).strip() else type(e).__name__}"
    if why is not None:
        return {"checked": 0, "confirmed": 0, "why": why}
    return {"checked": len(found), "confirmed": sum(t["probability"] < CONFIRMS for t in found),
            "threshold": CONFIRMS, "prompt": prompt_text(), "tokens": found, "controls": checked}


def line(verified):
    """The INFO line of verify()'s answer."""
    if verified["checked"] == 0:
        return f"under-trained: not verified: {verified['why']}"
    controls = ", ".join(f"{c['token'] or '#' + str(c['id'])} {c['probability']:.3g}" for c in verified["controls"])
    return (f"under-trained: verified by running the model: {verified['confirmed']} of the top {verified['checked']} "
            f"candidates confirmed (asked to copy one, the model gives it under {CONFIRMS:g} probability in each of "
            f"{STEPS} greedy steps)" + (f"; the queries, asked the same way: {controls}" if controls else ""))
