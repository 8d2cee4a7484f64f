"""Steps that hand an untrusted model to onnxruntime (or onnx's C++ checker) run here, in a child process.

A crash, abort, time-out or allocation failure inside a session then ends the child, not the tool: the
parent reports it as a finding about the model. The child runs under a wall-clock limit and an address-space
limit (RLIMIT_AS), a cap on the size of any file it writes (RLIMIT_FSIZE), no core files; `Limits` holds both, set from --timeout and --memory-limit.
"""
import contextlib
import itertools
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import time

from embed import physical_memory
from runtime.model.read.checked import Changed, source
from runtime.model.read.text import InspectError
from runtime.inspect.sandbox import answers, guard

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

TIMEOUT = 600.0  # seconds the whole command may take, by default (--timeout), for a model of at most a GiB
PER_GIB = 60.0  # and a minute more for each GiB of its files: --retie at 3 GiB took 148 s here (issue 38)
OUT_OF_MEMORY = 3  # the child's exit status when an allocation failed (runtime.inspect.sandbox.child)

GiB = 2**30


def default_timeout(path):
    """--timeout's default for the model at `path` (a file or a folder): TIMEOUT, plus PER_GIB for each GiB past the
    first of the regular files in its folder (for a file, the folder it lies in: its data files are there), so that a
    model this machine can run is not stopped by the default. Only sizes are read."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    total = 0
    try:
        for where, _, names in os.walk(folder) if os.path.isdir(path) else [(folder, None, os.listdir(folder))]:
            for name in names:
                try:
                    info = os.stat(os.path.join(where, name))
                except OSError:
                    continue
                total += info.st_size if stat.S_ISREG(info.st_mode) else 0  # a device or FIFO has no size
    except OSError:
        return TIMEOUT
    return TIMEOUT + PER_GIB * max(0.0, total / GiB - 1)


class StepFailed(InspectError):
    """onnx or onnxruntime refused the model with an error of its own (no crash): one line."""


class Limits:
    """What the children may take: `timeout` seconds of wall time from now for all of them together (the whole
    command's --timeout), `memory` bytes of address space each; `progress` is told each step as it starts
    (runtime.progress.Progress on a terminal; by default nothing); `committing()` is called once OUT is in place
    (guard.committing: from there the deadline no longer interrupts); `proving`: a --retie will prove what these
    children examine, so a session of the original they open anyway runs the proof's feeds too (jobs.proving)."""

    def __init__(self, timeout=TIMEOUT, memory=None, progress=None, committing=None, proving=False):
        self.timeout, self.memory, self.proving = timeout, memory, proving
        self.deadline = time.monotonic() + timeout
        self.progress = progress or (lambda stage: None)
        self.committing = committing or (lambda: None)  # told just before the outputs are placed (guard.committing)

    def remaining(self):
        """Seconds left before the deadline (at least a millisecond, so a step that starts late fails at once)."""
        return max(0.001, self.deadline - time.monotonic())

    def memory_for(self, model_bytes):
        """The address-space limit: as given, else 4 GiB plus 6x the model (two sessions and their copies),
        at most three quarters of the machine's memory."""
        if self.memory is not None:
            return self.memory
        physical = physical_memory()
        return 4 * GiB + 6 * model_bytes if physical is None else min(4 * GiB + 6 * model_bytes, physical * 3 // 4)


def call(job, what, limits, model_bytes):
    """Run `job` (a dict made by runtime.inspect.sandbox.jobs) in a child under `limits`; its answer (the
    sandbox.answers type of its kind), or InspectError saying what happened to onnxruntime while `what` (e.g.
    "building the optimized model")."""
    return start(job, what, limits, model_bytes).result()


def start(job, what, limits, model_bytes):
    """call(), started: the Child running `job`, whose result() waits for it. Another step may run meanwhile (each
    job's files are its own); stop() ends it early."""
    return Child(job, what, limits, model_bytes)


def side_by_side(model_bytes, children=2):
    """Whether `children` children may run at once on a model of `model_bytes`: a second core to run them, and
    memory available for all (each holds up to about three copies of the model while it runs)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores >= 2 and available_memory() >= children * (3 * model_bytes + GiB)


def available_memory():
    """The bytes of memory the kernel says are available now (MemAvailable), 0 where it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


_JOB_NUMBERS = itertools.count()

_ahead = None  # the child prestart() started, waiting for its job; the next Child takes it


def prestart(folder):
    """Start the next step's child now, ahead of its job: it imports onnxruntime and the jobs' modules (about 0.2 s)
    on another core while this process reads and checks the model or writes OUT, then waits, having read nothing
    of any model. The next Child hands it its job and its limits, which it sets on itself before it reads the job
    (runtime.inspect.sandbox.child). One child ahead at most; let_go_ahead() ends one no step took. `folder`: the
    scratch folder its TMPDIR names until the job names its own. The waiting child (a Popen)."""
    global _ahead
    if _ahead is None:
        _ahead = _spawn(folder, {resource.RLIMIT_CORE: 0})
    return _ahead


def let_go_ahead():
    """End the child prestart() started if no step took it (nothing else runs in it)."""
    global _ahead
    child, _ahead = _ahead, None
    if child is not None:
        child.kill()
        child.communicate()


def _spawn(folder, confined):
    """A child process of runtime.inspect.sandbox.child waiting for its order on stdin (a JSON line: the job's path,
    the limits to set, its TMPDIR), under the rlimits `confined` from its start, dying with this process; its
    command line names `folder`, as `ps` shows it."""
    def confine():  # in the child, before exec: nothing here may raise, so no limit goes past an inherited one
        for kind, limit in confined.items():
            resource.setrlimit(kind, (limit, limit))
        guard.die_with_parent()

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT] + sys.path[1:]), TMPDIR=folder)
    # Signals held off while the child is forked: one landing between fork and exec ran Python's handler in the
    # forked copy (random's reseed at fork, confine), which printed its own "Exception ignored" lines. The child
    # keeps them blocked (the mask survives exec): on any of them this process kills it.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, guard.SIGNALS)
    try:
        return subprocess.Popen([sys.executable, "-m", "runtime.inspect.sandbox.child", "-", folder], cwd=_ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                preexec_fn=confine)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one that came meanwhile lands here, the child known


class Child:
    """One step in a child process (start()): its job written, the child running under `limits` (the child
    prestart() started, if one waits, else a new one)."""

    def __init__(self, job, what, limits, model_bytes):
        global _ahead
        self.what, self.limits, self.job = what, limits, job
        self.memory = _within(resource.RLIMIT_AS, limits.memory_for(model_bytes))
        limits.progress(f"onnxruntime, in a child: {what}")
        number = next(_JOB_NUMBERS)
        path = os.path.join(job["folder"], f"{number}.job.json")
        self.answer = job["result"] = os.path.join(job["folder"], f"{number}.result.json")
        with open(path, "w") as f:
            json.dump(job, f)
        written = 3 * model_bytes + GiB  # any one file it writes; past that, a write fails (EFBIG), nothing fills the disk
        self.file_limit = _within(resource.RLIMIT_FSIZE, written)
        self.file_limited = self.file_limit < written  # the user's `ulimit -f` is lower than this step may need
        confined = {resource.RLIMIT_AS: self.memory, resource.RLIMIT_FSIZE: self.file_limit, resource.RLIMIT_CORE: 0}
        self.child, _ahead = _ahead or _spawn(job["folder"], confined), None
        order = {"job": path, "limits": [[int(kind), limit] for kind, limit in confined.items()],
                 "tmpdir": job["folder"]}
        try:
            self.child.stdin.write(json.dumps(order).encode() + b"\n")
        except BrokenPipeError:  # it ended already: result() says how
            pass
        finally:
            with contextlib.suppress(BrokenPipeError):
                self.child.stdin.close()
            self.child.stdin = None  # (communicate() would flush it again)

    def stop(self):
        """End the child now if it still runs (nothing of it is reported)."""
        if self.child.returncode is None:
            self.child.kill()
            self.child.communicate()

    def result(self):
        """Wait for the child: its answer (answers.of its job's kind), or InspectError (Changed, StepFailed) saying
        what happened."""
        what, child = self.what, self.child
        try:
            _, err = child.communicate(timeout=self.limits.remaining())
        except subprocess.TimeoutExpired:
            self.stop()
            raise InspectError(f"onnxruntime did not finish {what} within the command's --timeout "
                               f"{self.limits.timeout:g} s and was stopped (raise --timeout if the model is simply "
                               "large)") from None
        except BaseException:  # interrupted or terminated: no child outlives the tool
            self.stop()
            raise
        return self._answer(err.decode(errors="replace"))

    def _answer(self, err):
        what, child, job = self.what, self.child, self.job
        if child.returncode < 0:
            name = signal.Signals(-child.returncode).name
            if "checked" in job and -child.returncode == signal.SIGBUS:
                source(job["checked"]).close()  # Changed, if a file shrank under onnxruntime's mapping
            raise InspectError(f"onnxruntime crashed ({name}) while {what}: the model is malformed or hostile"
                               f"{_memory_hint(err, self.memory)}")
        if child.returncode == OUT_OF_MEMORY or "bad_alloc" in err:
            raise InspectError(f"onnxruntime ran out of memory while {what} (limit {self.memory / GiB:.1f} GiB of "
                               "address space; raise --memory-limit if the model is simply large)")
        if child.returncode != 0 or not os.path.exists(self.answer):
            last = (err.strip().splitlines() or ["no message"])[-1]
            raise InspectError(f"the isolated step failed while {what}: {last[:300]}")
        with open(self.answer) as f:
            answer = json.load(f)
        if "changed" in answer:
            raise Changed(answer["changed"])
        if "error" in answer and self.file_limited and _reached(job["folder"], self.file_limit):
            raise InspectError(f"a file onnxruntime wrote while {what} reached the file size limit in force "
                               f"({self.file_limit} bytes: the shell's `ulimit -f`?); raise it and run again (the "
                               "model is not what failed)")
        if "error" in answer:
            raise StepFailed(f"onnx or onnxruntime refused it while {what}: {answer['error']}")
        return answers.of(job["kind"], answer)


def _within(kind, most):
    """rlimit `kind` for the child: `most`, or the hard limit this process inherited if that is lower (a limit
    cannot be raised past it: a `ulimit -v` from the user's shell stays in force)."""
    _, hard = resource.getrlimit(kind)
    return most if hard == resource.RLIM_INFINITY else min(most, hard)


def _reached(folder, limit):
    """Whether a file the child wrote in `folder` is as long as the file size limit: a write past it failed."""
    try:
        return any(e.is_file(follow_symlinks=False) and e.stat().st_size >= limit for e in os.scandir(folder))
    except OSError:
        return False


def _memory_hint(err, memory):
    return f" (or it hit the {memory / GiB:.1f} GiB memory limit)" if "alloc" in err.lower() else ""
