"""The second process compare works in, behind one interface: submit(key, ...) now, result(key) when needed.

A one-worker ProcessPoolExecutor from a forkserver (forking a process whose onnxruntime threads may hold locks
can leave the child waiting forever). A task nobody has started by the time it is asked for is taken back and
computed here; while a started one runs, this process takes the last tasks still waiting (they are needed
later), so neither process idles. No check sees any of this: the Reference and the Sessions ask it.
"""
import multiprocessing
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import shared_memory

import numpy as np

_ENDING = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}  # the signals that end a run by raising


def quiet(stage):
    """No progress lines."""


class Pool:
    """Tasks keyed by name: submitted to the second process, answered from it or, if it had not started them,
    computed here by the `local` function given with each."""

    def __init__(self, enabled=True):
        context = multiprocessing.get_context("forkserver")
        self._executor = ProcessPoolExecutor(max_workers=1, mp_context=context) if enabled else None
        self._futures, self._local, self._done = {}, {}, {}
        self._shared = []

    def share(self, array):
        """The name of shared memory holding a copy of `array` for the second process to read, freed by close().
        The pool holds it from the moment it exists (signals held off meanwhile), so a run ended by a signal or
        an error at any point leaves nothing in /dev/shm: its owner's close() is in a finally already."""
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING)
        try:
            memory = shared_memory.SharedMemory(create=True, size=max(1, array.nbytes))
            self._shared.append(memory)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a signal that came meanwhile is raised here
        np.ndarray(array.shape, array.dtype, memory.buf)[...] = array
        return memory.name

    def submit(self, key, function, args, local):
        """Start function(*args) in the second process (module-level, picklable); `local()` computes the same here."""
        self._local[key] = local
        if self._executor is None:
            return
        self._futures[key] = self._executor.submit(function, *args)

    @property
    def enabled(self):
        """Whether tasks go to a second process (else each is computed here when asked)."""
        return self._executor is not None

    def __contains__(self, key):
        return key in self._local

    def result(self, key, progress=quiet):
        """The task's answer: taken back and computed here if the second process had not started it."""
        if key in self._done:
            return self._done.pop(key)
        future = self._futures.pop(key, None)
        if future is None or future.cancel():
            return self._local.pop(key)()
        while not future.done():  # meanwhile, the last task still waiting is work this process would do later
            waiting = next((k for k in reversed(list(self._futures)) if self._futures[k].cancel()), None)
            if waiting is None:
                break
            del self._futures[waiting]
            progress(f"{waiting[0]} here, while the second process works")
            self._done[waiting] = self._local.pop(waiting)()
        progress(f"waiting for {key[0]} (second process)")
        self._local.pop(key)
        return future.result()

    def close(self, timeout=10.0):
        """Stop the second process, drop what it had not done and free the shared memory; safe to call twice. Ends
        within a few `timeout`s whatever the worker was doing: nothing here waits on the executor's threads without
        a limit."""
        try:
            self._stop(timeout)
        finally:
            while self._shared:
                memory = self._shared.pop()
                memory.close()
                memory.unlink()

    def _stop(self, timeout):
        executor, self._executor = self._executor, None
        if executor is None:
            return
        # A failed run must not leave the worker computing: end it (the executor has no public kill before 3.14).
        # Not by terminate() then shutdown(wait=True): a worker ended part-way through sending a result (the
        # untied head's logits are megabytes, written in pipe-sized pieces) left the executor's manager thread in
        # recv() waiting for the rest forever, since this process holds the result pipe's other writing end, and
        # the join waited for that thread.
        processes = list((getattr(executor, "_processes", None) or {}).values())
        manager = getattr(executor, "_executor_manager_thread", None)
        results = getattr(executor, "_result_queue", None)
        executor.shutdown(wait=False, cancel_futures=True)  # flags it and wakes the manager; waits on nothing
        # while the worker lives the manager's reads end: let it drop the tasks not started first, so that none it
        # marks failed once the worker is gone is already cancelled (3.11 raises InvalidStateError in that thread;
        # a worker that died by itself cannot be waited for: the manager may be stuck reading what it sent)
        deadline = time.monotonic() + timeout
        while (manager is not None and manager.is_alive() and getattr(executor, "_cancel_pending_futures", False)
               and all(process.is_alive() for process in processes) and time.monotonic() < deadline):
            time.sleep(0.002)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout)
            if process.exitcode is None:  # SIGTERM held off; SIGKILL cannot be
                process.kill()
                process.join(timeout)
        if results is not None:  # no worker is left to write: this end closed, a read cut short ends (EOFError),
            results._writer.close()  # which the manager takes as the pool broken, and it exits
        if manager is not None:
            manager.join(timeout)
        if results is not None and (manager is None or not manager.is_alive()):
            results._reader.close()
