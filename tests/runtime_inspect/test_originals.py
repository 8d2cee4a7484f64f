"""The original model's outputs on the proof's feeds, given ahead by inspect's child (sandbox.originals): where a
--retie will prove the model and a session of its own writes the layout, that session shows the heads' hidden
vectors and runs the proof's feeds, and the proof reads what it saved instead of loading the original again. The
saved outputs must be what the proof's own session of the original gives, bit for bit, on the very feeds the proof
makes; anything else is not taken."""
import json
import os

import numpy as np
import pytest

from graphs.storage import stage
from runtime.inspect.examine import inspect_model
from runtime.inspect.retie.rewrite import planned
from runtime.inspect.sandbox import isolated, jobs, originals, proof
from runtime.model.read.model import load
from tests.helpers import FIXTURES, inspected

GPT2 = os.path.join(FIXTURES, "optimum_gpt2", "model.onnx")  # inline: its layout written by a session of its own


def _ahead(tmp_path, proving=True):
    """(inspect_model's dict with a retie to come, the proof's feed sets of it, the names its head shows)."""
    info = inspect_model(GPT2, str(tmp_path), isolated.Limits(300, proving=proving))
    job = {"rows": info["rows"], "shape": info["shape"]}
    (head,) = [h for h in info["heads"] if "as_table" in h and h["initializer"] in
               {p["head"] for p in info["pairs"]}]
    return info, proof.proof_feeds(job, info["model"].proto), [head["node"].input[0]]


def test_the_outputs_given_ahead_are_the_proofs_own_run_of_the_original_bit_for_bit(tmp_path):
    info, feed_sets, watched = _ahead(tmp_path)
    olds = originals.given(info["originals"], feed_sets, watched)
    assert olds is not None and len(olds) == len(feed_sets) >= 2  # every step of the proof, the hidden vector shown
    model = load(GPT2)
    session, shown = proof._original(model.proto, os.path.dirname(GPT2), watched, True)  # as the proof opens it
    for old, run in zip(olds, proof.run_each(session, shown, [f for _, f in feed_sets])):
        mine = proof.outputs_of(run)
        assert sorted(old) == sorted(mine) and watched[0] in mine
        for name, value in mine.items():
            assert old[name].dtype == value.dtype and old[name].shape == value.shape
            assert np.array_equal(old[name].view(np.uint8), value.view(np.uint8)), name


def test_outputs_run_on_other_feeds_or_without_a_watched_value_are_not_taken(tmp_path):
    info, feed_sets, watched = _ahead(tmp_path)
    said, feeds = feed_sets[0]
    name = next(n for n, v in feeds.items() if v.dtype == np.int64 and v.size)
    other = dict(feeds, **{name: feeds[name] ^ 1})  # one bit of one feed
    assert originals.given(info["originals"], [(said, other)] + feed_sets[1:], watched) is None
    assert originals.given(info["originals"], feed_sets[1:], watched) is None  # not the same steps
    assert originals.given(info["originals"], feed_sets, watched + ["never_shown"]) is None
    assert originals.given(info["originals"], feed_sets, watched) is not None


def test_nothing_is_run_ahead_without_a_retie_to_come(tmp_path):
    info, _, _ = _ahead(tmp_path, proving=False)
    assert info["originals"] is None and "originals.npz" not in os.listdir(tmp_path)


@pytest.mark.parametrize("keep", [False, True])
def test_a_retie_proven_on_outputs_given_ahead_writes_what_it_proved(tmp_path, keep):
    out = tmp_path / "fixed.onnx"
    done = inspected(GPT2, "--retie", out, *(["--logits-to-keep", "1"] if keep else []))
    assert "every other output bit for bit" in " ".join(done.stdout.split()) and out.exists()


@pytest.mark.parametrize("ahead", [True, False])
def test_the_proof_opens_no_session_of_the_original_where_its_outputs_were_given_ahead(tmp_path, monkeypatch, ahead):
    info, _, _ = _ahead(tmp_path)
    model = info["model"]
    rewritten, sources = planned(model, info, lambda line: None)
    staged = stage(model.proto, tmp_path / "out.onnx", sources=sources)
    job = json.loads(json.dumps(jobs.prove(jobs.Proof(  # as the child gets it
        GPT2, model.checked, staged.path, rewritten, info["rows"], info["shape"],
        originals=info["originals"] if ahead else None), str(tmp_path))))
    opened = []

    class Counted(proof.Runner):
        def __init__(self, onnx_model, **kwargs):
            opened.append(onnx_model)
            super().__init__(onnx_model, **kwargs)

    monkeypatch.setattr(proof, "Runner", Counted)
    proven = proof.prove(job)
    staged.discard()
    assert rewritten and proven.failures == [] and proven.heads["formats"] == ["float32"]  # proven either way
    assert len(opened) == (1 if ahead else 2)  # the retied model's session, and the original's unless given ahead
