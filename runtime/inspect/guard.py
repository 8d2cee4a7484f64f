"""inspect's work runs in a forked worker; the process the user started only waits for it, so that whatever ends
the worker ends the command in one line, with nothing left behind.

Python cannot catch a SIGBUS: reading a memory-mapped data file that someone truncated meanwhile kills the
reader outright, with no message and no cleanup. A hard time limit for the whole command needs someone outside
the work too. So this process keeps the two things only it can be trusted with, the scratch folder and the
deadline, and forwards the signals the user sends. The worker (and the onnxruntime child it starts) dies with
it if it is killed.
"""
import ctypes
import faulthandler
import os
import shutil
import signal
import sys
import time

GRACE = 10.0  # seconds the worker has, past its deadline, to unwind (it stops itself at the deadline)
_SI_KERNEL = 0x80  # si_code of a signal the kernel sent: the terminal's Ctrl-C or hang-up, which reach the worker too
_PR_SET_PDEATHSIG = 1


class TimedOut(BaseException):
    """The command's --timeout passed: raised in the worker where it is, so everything on the way out runs."""


def die_with_parent():
    """Ask Linux to SIGKILL this process when its parent dies (nothing elsewhere): no work outlives the command."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _timed_out(signum, frame):
    signal.setitimer(signal.ITIMER_REAL, 0)
    raise TimedOut()


def committing():
    """In the worker: the outputs are about to be placed (links and small copies, quick), so the deadline no longer
    interrupts; the supervisor's own, GRACE seconds later, still stands. Elsewhere, nothing."""
    if signal.getsignal(signal.SIGALRM) is _timed_out:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _flush():
    for stream in (sys.stdout, sys.stderr):  # None when the descriptor was closed (`>&-`)
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def supervise(work, timeout, scratch, staging, prog, out=None):
    """Run work() (an exit status) in a forked worker and return its status.

    `timeout`: seconds for the whole command (the worker raises TimedOut at the deadline and is killed GRACE
    seconds later); `scratch`: a folder removed when the worker ends however it ends; `staging`: the folder where
    the worker stages outputs as `.saving-<pid>-*` (graphs.storage.save), removed too if the worker dies; `out`:
    the output it may place (absent when this starts), so a line about a killed worker says whether it is there. A
    worker killed by a signal ends the command with one line on stderr (`prog: error: ...`) and status 2.
    """
    watched = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        _flush()
        pid = os.fork()
        if pid == 0:  # the worker
            _worker(work, timeout, mask, prog)
        status = _wait(pid, time.monotonic() + timeout + GRACE)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        shutil.rmtree(scratch, ignore_errors=True)
    if status is not None and os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    _remove_staged(staging, pid)
    sig = None if status is None else os.WTERMSIG(status)
    if sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        return 128 + sig
    what = "nothing written" if out is None or not os.path.lexists(out) else \
        f"{out} was placed, its sidecar files perhaps not all"
    why = "did not finish within --timeout %g s and was stopped" % timeout if sig is None else {
        signal.SIGBUS: "a file of the model changed while it was being read (SIGBUS: truncated while mapped?)",
        signal.SIGKILL: "killed (SIGKILL: out of memory?)"}.get(sig, f"crashed ({signal.Signals(sig).name})")
    print(f"{prog}: error: {why}; {what}", file=sys.stderr)
    return 2


def _worker(work, timeout, mask, prog):
    """The forked worker's whole life: run work() under the deadline, then leave with its status (never returns)."""
    code = 1
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        faulthandler.disable()  # a SIGBUS here is this process's to report in one line, not a dump's
        die_with_parent()
        signal.signal(signal.SIGALRM, _timed_out)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        code = work()
    except TimedOut:  # before or after work() could say it
        print(f"{prog}: error: did not finish within --timeout {timeout:g} s and was stopped; nothing written",
              file=sys.stderr)
        code = 2
    except BaseException:  # a bug, not the model: its traceback, as Python would print it
        sys.excepthook(*sys.exc_info())
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _flush()
        finally:
            os._exit(code)


def _wait(pid, deadline):
    """The worker's wait status, forwarding SIGINT, SIGTERM and SIGHUP to it; None if it outlived `deadline`
    (killed)."""
    while True:
        info = signal.sigtimedwait({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD},
                                   max(0.0, deadline - time.monotonic()))
        if info is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        if info.si_signo == signal.SIGCHLD:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
        elif info.si_code != _SI_KERNEL:  # the terminal's Ctrl-C or hang-up reached the worker already
            os.kill(pid, info.si_signo)


def _remove_staged(folder, pid):
    """Remove what a dead worker was staging in `folder` (graphs.storage.save names it by the worker's pid)."""
    if folder is None or not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name.startswith(f".saving-{pid}-"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
