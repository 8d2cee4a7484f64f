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

from embed import ENDING
from runtime.model.read.text import printable

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
    """In the worker: OUT is in place and what is left is quick (lines, sidecar copies of at most 16 MiB each), so
    the deadline no longer interrupts it; the supervisor's own, GRACE seconds later, still stands. Elsewhere (a
    caller running the work in its own process), nothing."""
    if signal.getsignal(signal.SIGALRM) is _timed_out:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _too_long(timeout):
    return f"did not finish within --timeout {timeout:g} s and was stopped"


def _flush():
    for stream in (sys.stdout, sys.stderr):  # None when the descriptor was closed (`>&-`)
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


_ENDING = ENDING  # the worker unwinds on these and says so (embed's, as every command answers them)

_FATAL = (signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)  # would end this process unannounced

_WATCHED = {*_ENDING, *_FATAL, signal.SIGCHLD}

SIGNALS = (*_ENDING, *_FATAL)  # every signal the command answers in one line: held off around a fork (isolated)


def supervise(work, timeout, scratch, staging, prog, out=None):
    """Run work() (an exit status) in a forked worker and return its status.

    `timeout`: seconds for the whole command (the worker raises TimedOut at the deadline and is killed GRACE
    seconds later); `scratch`: a folder removed when the worker ends however it ends; `staging`: the folder where
    the worker stages outputs as `.saving-<pid>-*` (graphs.storage.save) and `.sidecar-<pid>-*`, removed too if
    the worker dies or fails, with whatever it had linked into place from them; `out`: the output it may place
    (absent when this starts), so a line about a killed worker says whether it is there. A worker killed by a
    signal ends the command with one line on stderr (`prog: error: ...`) and status 2, or 128 + the signal this
    process was sent.
    """
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    reaping = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # inherited ignored, the kernel would reap the worker
    try:
        _flush()
        pid = os.fork()
        if pid == 0:  # the worker
            signal.signal(signal.SIGCHLD, reaping)
            _worker(work, timeout, mask, prog)
        status, sent = _wait(pid, time.monotonic() + timeout + GRACE)
        if status is None or not os.WIFEXITED(status) or os.WEXITSTATUS(status):
            _remove_staged(staging, pid)  # a worker that unwound can be stopped inside its own clean-up too
        if _ended_by_signal(status):  # the command ends with it: another on its way (a second Ctrl-C) changes nothing
            for sig in _ENDING:
                signal.signal(sig, signal.SIG_IGN)
        shutil.rmtree(scratch, ignore_errors=True)  # signals still held: a second Ctrl-C cannot cut this short
        while signal.sigtimedwait(_WATCHED - {signal.SIGCHLD}, 0):  # what came meanwhile was for the worker
            pass
    finally:
        signal.signal(signal.SIGCHLD, reaping)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        shutil.rmtree(scratch, ignore_errors=True)
    if status is not None and os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    sig = None if status is None else os.WTERMSIG(status)
    what = "nothing written" if out is None or not os.path.lexists(out) else \
        f"{printable(out)} was placed, its sidecar files perhaps not all"
    if sig in _ENDING or (sig is not None and sig == sent):
        print(f"{prog}: stopped ({signal.Signals(sig).name}); {what}", file=sys.stderr)
        return 128 + sig
    why = _too_long(timeout) if sig is None else {
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
    except TimedOut:  # wherever it was, the work unwound on the way here
        print(f"{prog}: error: {_too_long(timeout)}; nothing written (raise --timeout if the model is simply large)",
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


def _ended_by_signal(status):
    if status is None:
        return False
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status) in {128 + sig for sig in _ENDING}
    return os.WTERMSIG(status) in _ENDING


def _wait(pid, deadline):
    """(the worker's wait status, the last signal forwarded to it or None), forwarding what this process is sent
    (SIGALRM and SIGUSR1/2 as SIGTERM: the worker has its own use of SIGALRM); status None if the worker outlived
    `deadline` (killed then)."""
    sent = None
    while True:
        info = signal.sigtimedwait(_WATCHED, max(0.0, deadline - time.monotonic()))
        if info is None:
            _kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, sent
        if info.si_signo == signal.SIGCHLD:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status, sent
        elif info.si_code != _SI_KERNEL:  # sent to this process: pass it on (the terminal's reach the worker too)
            sent = info.si_signo
            _kill(pid, signal.SIGTERM if info.si_signo in (signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2) else sent)
        else:
            sent = info.si_signo


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended meanwhile: its status is waiting
        pass


def _remove_staged(folder, pid):
    """Remove what a dead worker was staging in `folder` (named by its pid: graphs.storage.save's `.saving-*`,
    sidecars' `.sidecar-*`), and each file it had already linked into place from there (the same inode): no OUT
    or data file is left half-placed."""
    if folder is None or not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(f".saving-{pid}-") and os.path.isdir(path):
            for staged in os.listdir(path):
                placed = os.path.join(folder, staged)
                try:
                    if os.path.samefile(placed, os.path.join(path, staged)):
                        os.remove(placed)
                except OSError:
                    pass
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(f".sidecar-{pid}-"):
            try:
                os.remove(path)
            except OSError:
                pass
