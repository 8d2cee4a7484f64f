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


def claim(claims, index):
    """Take reference pass `index` for this process: False if the other process took it first."""
    with claims.get_lock():
        if claims[index]:
            return False
        claims[index] = 1
        return True


def table_pass(table, query, what, argument):
    """One pure-Python pass over `table`: embed.onehot_lookup of ids, embed.neighbors of `query` (every other token,
    ranked) by a metric, or embed.logits against one of its rows."""
    if what == "onehot":
        return embed.onehot_lookup(table, argument)
    if what == "neighbors":
        return embed.neighbors(table, query, len(table), argument)
    return embed.logits(table, table[argument])


def table_passes(shared, shape, query, stretch, work, claims):
    """In the second process: the reference table, from shared memory as Python floats (the very values
    embed.make_table made, float64 round-trips them exactly), then each (key, what, table factor, argument) of
    `work` that `claims` shows nobody has taken (the main process takes some when it would otherwise wait)."""
    memory = shared_memory.SharedMemory(name=shared)
    table = np.ndarray(shape, np.float64, memory.buf).tolist()
    memory.close()
    stretched = {None: table}
    for index, (key, what, factor, argument) in enumerate(work):
        if not claim(claims, index):
            continue
        if factor not in stretched:
            stretched[factor] = stretched_table(table, stretch, factor)
        yield key, table_pass(stretched[factor], query, what, argument)


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

    def ready(self, key):
        """Whether the task's result has come, without waiting."""
        while key not in self._results and self._pipe.poll():
            try:
                got, value = self._pipe.recv()
            except EOFError:
                break
            self._results[got] = value
        return key in self._results

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
