"""The second process compare uses: a forkserver child running tasks and sending each result back."""
import multiprocessing
from multiprocessing import shared_memory

import numpy as np

import embed


def quiet(stage):
    """No progress lines from the second process."""


def run_tasks(conn, tasks):
    """In the second process: run each (key, function, args) in order and send (key, result) as it finishes; a
    task with key None yields its own (key, result) pairs."""
    for key, function, args in tasks:
        for pair in function(*args) if key is None else [(key, function(*args))]:
            conn.send(pair)
    conn.close()


def stretched_table(table, token, factor):
    """embed.stretch_row(table, token, factor), made by embed.stretch_row on the one row it changes: the other rows
    are already floats, so they are shared rather than copied (38 million values copied take seconds)."""
    rows = list(table)
    rows[token] = embed.stretch_row([table[token]], 0, factor)[0]
    return rows


def table_passes(shared, shape, query, stretch, work):
    """In the second process: the reference table, from shared memory as Python floats (the very values
    embed.make_table made, float64 round-trips them exactly), then each (key, what, table factor, argument) of
    `work`: embed.onehot_lookup, embed.neighbors (every other token, ranked) or embed.logits of a row."""
    memory = shared_memory.SharedMemory(name=shared)
    table = np.ndarray(shape, np.float64, memory.buf).tolist()
    memory.close()
    stretched = {None: table}
    for key, what, factor, argument in work:
        if factor not in stretched:
            stretched[factor] = stretched_table(table, stretch, factor)
        rows = stretched[factor]
        if what == "onehot":
            yield key, embed.onehot_lookup(rows, argument)
        elif what == "neighbors":
            yield key, embed.neighbors(rows, query, len(rows), argument)
        else:
            yield key, embed.logits(rows, rows[argument])


class Worker:
    """A second process running work that needs nothing from this one (module-level functions, picklable
    arguments). It comes from a forkserver, not a fork of this process: forking a process whose native threads
    (onnxruntime's pools) may hold locks can leave the child waiting forever."""

    def __init__(self, tasks, keys=()):
        context = multiprocessing.get_context("forkserver")
        self._pipe, child_end = context.Pipe(duplex=False)
        self._process = context.Process(target=run_tasks, args=(child_end, tasks), daemon=True)
        self._process.start()
        child_end.close()
        self.tasks = {key: (function, args) for key, function, args in tasks if key is not None}
        self.tasks.update({key: None for key in keys})  # answered by a task that yields several
        self._results = {}

    def result(self, key, progress):
        """The task's result, waiting for it if need be."""
        while key not in self._results:
            progress(f"waiting for {key[0]} (second process)")
            try:
                got, value = self._pipe.recv()
            except EOFError:  # the process is gone
                raise RuntimeError(f"the second process ended before computing {key}") from None
            self._results[got] = value
        return self._results[key]

    def close(self):
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
