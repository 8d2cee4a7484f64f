"""One command measured as a person runs it: its wall time to the moment it ended and the peak of its process
tree's summed Pss, sampled by another thread (runtime.bench.scale's generated models, real_models' real exports,
real_table's compare runs)."""
import os
import subprocess
import threading
import time


def _tree(pid):
    """The pids of `pid` and every process under it, now."""
    found, stack = [], [pid]
    while stack:
        p = stack.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


def _pss(pids):
    """The summed Pss of `pids` in bytes (a process that ended meanwhile counts 0)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def measure(argv, cwd=None):
    """{wall_s, peak_bytes, status}: `argv` run to its end, its process tree's summed Pss sampled every 0.1 s by
    another thread, its wall time up to the moment it ended (not to the next sample: a 0.4 s session would be
    timed to a quarter)."""
    start = time.monotonic()
    child = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, ended = [0], threading.Event()

    def sample():
        while not ended.is_set():
            peak[0] = max(peak[0], _pss(_tree(child.pid)))
            ended.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = child.stderr.read().decode(errors="replace").strip().splitlines()  # to its end (a full pipe would stall it)
    child.wait()
    wall = time.monotonic() - start
    ended.set()
    sampler.join()
    return {"wall_s": wall, "peak_bytes": peak[0], "status": child.returncode,
            "error": err[-1] if err and child.returncode else None}
