"""The original model's outputs on the proof's feeds, given ahead. Where inspect's child opens a session of the
original of its own to write the layout (child._written_apart: the model measured is let go first) and a --retie
will prove the model, that session also shows the heads' hidden vectors and runs the proof's feeds, and the outputs
are saved here: the proof then reads them instead of opening the original once more (a load of the whole model).
The proof takes them only where they were run on the very feeds it makes (bit for bit) and show every value it
compares; otherwise it runs the original itself, as before."""
import numpy as np


def save(outputs, feed_sets, path):
    """{"path", "index"} for the outputs of the original (`outputs`: one dict per feed set of `feed_sets`, [(what,
    feeds)]) saved with their feeds at `path` (.npz, arrays in order; "index": [[what, output names, feed names]]),
    or None where one is not a plain array (np.load would need pickle)."""
    arrays, index = [], []
    for (said, feeds), run in zip(feed_sets, outputs):
        index.append([said, list(run), list(feeds)])
        arrays += [np.asarray(v) for v in run.values()] + [np.asarray(v) for v in feeds.values()]
    if any(a.dtype.hasobject for a in arrays):
        return None
    with open(path, "wb") as f:
        np.savez(f, *arrays)
    return {"path": path, "index": index}


def given(originals, feed_sets, watched):
    """The original's outputs saved ahead (save's `originals`), one dict per feed set, where they were run on
    exactly `feed_sets` (the same steps, the same feeds bit for bit) and show every name of `watched`; else None."""
    if not originals or [entry[0] for entry in originals["index"]] != [said for said, _ in feed_sets]:
        return None
    olds = []
    with np.load(originals["path"], allow_pickle=False) as data:
        arrays = (data[f"arr_{i}"] for i in range(len(data.files)))
        for (_, outputs, fed), (_, feeds) in zip(originals["index"], feed_sets):
            run = {name: next(arrays) for name in outputs}
            saved = {name: next(arrays) for name in fed}
            if saved.keys() != feeds.keys() or not all(_same(saved[n], feeds[n]) for n in feeds) or \
                    not set(watched) <= run.keys():
                return None
            olds.append(run)
    return olds


def _same(a, b):
    """Whether two arrays are the same, bit for bit (dtype and shape too)."""
    b = np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
