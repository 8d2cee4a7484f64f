"""d: resident memory a session adds, per table byte, each model in a fresh process with the Runner's settings."""
import os

import graphs
from runtime.bench.probes import child
from runtime.bench.timing import progress

def _probe(path, width, arena=False):
    """(bytes at start, bytes after a 64-token run, seconds of a later run) of a fresh process's session."""
    start, after, seconds = child("session_memory", path, width, arena)
    return start, after, seconds


def bench_memory(sizes, folder):
    """Tied and untied heads, inline and external, at each size (and the tied head once more with the arena)."""
    rows = []
    for vocab, width in sizes:
        table, head = graphs.make_table(vocab, width), graphs.make_table(vocab, width, seed=1)
        # the Runner's settings for every layout, then the tied head once more with the arena on, to show its price
        cases = [(tied, external, False) for tied in (True, False) for external in (False, True)] + [(True, True, True)]
        for tied, external, arena in cases:
            model = graphs.tied_logits(table) if tied else graphs.untied_logits(table, head)
            path = os.path.join(folder, f"m_{vocab}_{tied}_{external}.onnx")
            written = graphs.save(model, path, external=external, overwrite=True)
            start, after, _ = _probe(path, width, arena)
            rows.append({"vocab": vocab, "width": width, "tied": tied, "external": external, "arena": arena,
                         "table_bytes": table.nbytes, "at_start": start / table.nbytes,
                         "after_first_run": after / table.nbytes, "target": 1.10 if tied else 2.10})
            progress(f"memory V={vocab} D={width} {'tied' if tied else 'untied'} "
                     f"{'external' if external else 'inline'}{', arena on' if arena else ''}: "
                     f"{start / table.nbytes:.2f}x at start, {after / table.nbytes:.2f}x after the first run")
            for p in written:
                os.remove(p)
        del table, head
    return rows
