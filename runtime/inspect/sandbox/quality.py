"""The price of a lossy retie, in the isolated child: the original, the retied model and, where given, a float
reference run teacher-forced over windows of a text's tokens (each window from an empty past), and their
next-token distributions compared position by position as llama.cpp's `perplexity --kl-divergence` compares a
quantization with its float model: KL(P || Q) in nats, whether the top token is the same, and each model's
perplexity on the text (the method: docs/retie.md, "What a lossy retie costs")."""
import time

import numpy as np

from runtime.feeds import no_past_branch, shaped_feeds
from runtime.model.read.checked import source
from runtime.model.read.model import load
from runtime.runner import Runner
from runtime.inspect.sandbox import answers

ARENA = True  # onnxruntime's CPU arena kept: a 512-token window's activations reused, not faulted in at each run
# (SmolLM2's q4, one window: 1.1-1.3 s with it, 1.3-3.3 s without)
POSITIONS_AT_ONCE = 64  # positions compared at a time: 64 x 262144 float64 is 128 MiB a model


def log_softmax(logits):
    """log softmax over the last axis, in float64: [positions, vocab]. A -inf logit (a token a model rules out) has
    log probability -inf; a row of NaN stays NaN."""
    x = np.asarray(logits, np.float64)
    top = np.max(x, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    shifted = x - top
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def compared(p_logits, q_logits, targets):
    """Position by position, for logits [positions, vocab] of P and Q and the tokens that follow each position:
    (KL(P || Q) = sum_v p_v (log p_v - log q_v) in nats, whether argmax P == argmax Q, P's and Q's negative log
    likelihood of the target), each [positions] float64 / bool. A token P rules out (p_v = 0) adds nothing to the
    divergence; one P allows and Q rules out makes it infinite."""
    (found,) = compared_all(p_logits, [q_logits], targets)
    return found


def compared_all(p_logits, q_list, targets):
    """compared() of P against each Q of `q_list`, each model's log softmax made once a block of positions."""
    found = [([], [], [], []) for _ in q_list]
    rows = np.arange(len(targets))
    for a in range(0, len(targets), POSITIONS_AT_ONCE):
        b = min(len(targets), a + POSITIONS_AT_ONCE)
        lp = log_softmax(p_logits[a:b])
        p = np.exp(lp)
        top = np.argmax(p_logits[a:b], axis=-1)
        nll_p = -lp[rows[:b - a], targets[a:b]]
        for (kl, same, nlls_p, nlls_q), q_logits in zip(found, q_list):
            lq = log_softmax(q_logits[a:b])
            with np.errstate(invalid="ignore"):
                terms = np.where(np.isneginf(lp), 0.0, p * (lp - lq))
            kl.append(np.sum(terms, axis=-1))
            same.append(top == np.argmax(q_logits[a:b], axis=-1))
            nlls_p.append(nll_p)
            nlls_q.append(-lq[rows[:b - a], targets[a:b]])
    return [tuple(np.concatenate(parts) for parts in columns) for columns in found]


def perplexity(nll):
    """exp of the mean negative log likelihood (nats) of the scored tokens."""
    return float(np.exp(np.mean(nll)))


def summary(kl, same):
    """(mean KL, its 99th percentile (numpy's, interpolated linearly), the share of positions whose top token is
    the same)."""
    return float(np.mean(kl)), float(np.percentile(kl, 99)), float(np.mean(same))


class Scored:
    """One model of a quality job (jobs.scored), opened: its session, ids input, logits output and its feeds' plan;
    run(window) gives its logits (tests/fixtures/bench_one_table.py opens several side by side)."""

    def __init__(self, spec):
        if "checked" in spec:  # the user's model, opened as it was checked
            checked = source(spec["checked"])
            model = load(spec["checked"]["path"], checked.folder, data=checked.shell)
            self.proto = model.proto
            self.session = Runner(model.proto, data_folder=checked.folder, arena=ARENA).session
        else:  # the retied model this tool wrote
            self.proto, self.session = None, Runner(spec["model"], arena=ARENA).session
        self.ids, self.logits, self.rows, self.shape = spec["ids"], spec["logits"], spec["rows"], spec["shape"]
        self.spec = spec

    def run(self, window):
        """The logits of every position of `window` (token ids), run from an empty past: [len(window), vocab]."""
        if self.proto is None:
            import onnx
            self.proto = onnx.load(self.spec["model"], load_external_data=False)
        feeds = shaped_feeds(self.proto, self.rows, self.shape, len(window), past=0)
        feeds[self.ids] = np.asarray(window, dtype=feeds[self.ids].dtype).reshape(feeds[self.ids].shape)
        for name, value in feeds.items():  # every position counts on from 0, whatever the model's tables read
            if "position" in name and value.dtype.kind in "iu" and value.shape[-1:] == (len(window),):
                feeds[name] = np.broadcast_to(np.arange(len(window)), value.shape).astype(value.dtype)
        no_past_branch(feeds)
        (logits,) = self.session.run([self.logits], feeds)
        return logits.reshape(-1, logits.shape[-1])[-len(window):]


def measure(job):
    """answers.Quality of a quality job (jobs.quality): every window run through each model, every position after
    a window's first scored against the token that follows it."""
    began = time.monotonic()
    original, out = Scored(job["original"]), Scored(job["out"])
    reference = Scored(job["reference"]) if job.get("reference") else None
    parts = {"out": [], "reference_original": [], "reference_out": []}
    for window in job["windows"]:
        targets = np.asarray(window[1:])
        old, new = original.run(window)[:-1], out.run(window)[:-1]
        if old.shape != new.shape:
            return answers.Quality.failed(f"the models' logits differ in shape: {old.shape} and {new.shape}")
        if reference is None:
            parts["out"].append(compared(old, new, targets))
            continue
        ref = reference.run(window)[:-1]
        if ref.shape != old.shape:
            return answers.Quality.failed(f"the reference's logits have {ref.shape[-1]} tokens, the model's "
                                          f"{old.shape[-1]}: not the same vocabulary")
        # P = the original against OUT; P = the reference against both (each log softmax made once a block)
        parts["out"].append(compared(old, new, targets))
        against_old, against_new = compared_all(ref, [old, new], targets)
        parts["reference_original"].append(against_old)
        parts["reference_out"].append(against_new)
        del old, new, ref
    joined = {k: [np.concatenate(column) for column in zip(*v)] for k, v in parts.items() if v}
    kl, same, nll_old, nll_new = joined["out"]
    mean, p99, same_top = summary(kl, same)
    against = None
    if reference is not None:
        kl_old, same_old, nll_ref, _ = joined["reference_original"]
        kl_new, same_new, _, _ = joined["reference_out"]
        against = answers.Against(summary(kl_old, same_old)[0], summary(kl_new, same_new)[0],
                                  float(np.mean(same_old)), float(np.mean(same_new)), perplexity(nll_ref),
                                  summary(kl_old, same_old)[1], summary(kl_new, same_new)[1])
    return answers.Quality(len(kl), mean, p99, same_top, perplexity(nll_old), perplexity(nll_new), against,
                           round(time.monotonic() - began, 2))
