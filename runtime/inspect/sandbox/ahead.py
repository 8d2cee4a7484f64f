"""The original's outputs on the proof's feeds, run ahead by a session inspect's child opens anyway (issue 57's
decision): where a --retie will prove the model, the session measured (or the one that writes the layout apart,
work._written_apart) shows the heads' hidden vectors and, once measured, runs the proof's feeds; sandbox.originals
saves them, and the proof reads them instead of loading the original again. Where onnxruntime refuses to run the
original on those feeds, the refusal is the answer: the retie stops before its proof."""


def measured_showing(job, model, proto, feeds, written):
    """(sessions_growth's figures of the session measured, which writes the layout; the original's outputs saved
    for a --retie's proof, or None). Where `job` is proving (jobs.proving), that session shows the heads' hidden
    vectors (a few KiB of outputs more) and, once measured, runs the proof's feeds (run_ahead): the proof then loads
    the original no more (issue 57's decision). Where onnxruntime refuses the model with them shown, the model as
    it is."""
    from runtime.resident import resident, sessions_growth
    shown, showing = shown_copy(proto, job["proving"]["show"]) if job.get("proving") else (None, None)
    kept = []
    if showing is not None:
        try:
            figures = sessions_growth([(showing.SerializeToString(), model[1], feeds, job["layout"], written)],
                                      job["prepacking"], measure=resident, keep=kept)
            return figures, run_ahead(kept.pop(), shown, proto, job)
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001 - refused with them shown: measured as it is, the proof runs the original
            kept.clear()
    return sessions_growth([(*model, feeds, job["layout"], written)], job["prepacking"], measure=resident), None


def together_showing(models, showing, protos, job):
    """(sessions_growth's figures of every file's session held together, {file's index: the original's outputs
    saved for a --retie's proof}): each file in `showing` {index: (shown, its model with the heads' hidden vectors
    shown, serialized)} is measured showing them and, once all are measured, runs the proof's feeds (run_ahead), as
    measured_showing does for one file: the proof then loads it no more (issue 57's decision). Where onnxruntime
    refuses a model with them shown, every file as it is."""
    from runtime.resident import sessions_growth
    if showing:
        kept = []
        try:
            figures = sessions_growth([(showing[i][1], *run[1:]) if i in showing else run
                                       for i, run in enumerate(models)], job["prepacking"], keep=kept)
            given = {i: run_ahead(kept[i], showing[i][0], protos[i], job["files"][i]) for i in showing}
            return figures, given
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001 - refused with them shown: measured as they are, the proof runs them
            pass
        finally:
            kept.clear()
    return sessions_growth(models, job["prepacking"]), {}


def shown_copy(proto, names):
    """({name: the output that shows it}, a copy of `proto` (the model's shell) that also outputs `names`), or
    (None, None) where one cannot be shown (exposed.with_outputs' ValueError, onnx's shape inference failing: the
    proof runs the original then)."""
    import onnx

    from runtime.inspect.sandbox.exposed import shown_copy
    try:
        model, shown = shown_copy(proto, names)
    except (ValueError, onnx.shape_inference.InferenceError):
        return None, None
    return shown, model


def run_ahead(session, shown, proto, job):
    """The original's outputs on the proof's feeds from `session` (showing `shown`), saved where job["proving"]
    says (originals.save's answer); {"refused": proof.refused's line} where onnxruntime refuses to run it on one
    of them (the proof's own run of the original would: the retie stops there, before anything is written); or
    None where they cannot be made otherwise (the proof meets it again, and reports it)."""
    from runtime.inspect.sandbox import originals, proof
    try:
        feed_sets = proof.proof_feeds(job, proto)
    except Exception:  # noqa: BLE001 - OriginalFails, or anything else: the proof meets it again, and reports it
        return None
    outputs, runs = [], proof.run_each(session, shown, [f for _, f in feed_sets])
    for said, _ in feed_sets:
        try:
            outputs.append(proof.outputs_of(next(runs)))
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - onnxruntime's refusal, whatever its type, is the finding
            return {"refused": proof.refused(said, e)}
    runs.close()
    return originals.save(outputs, feed_sets, job["proving"]["out"], shown)
