"""compare when it cannot go on: a graph builder raising while the second process works ends at once, in one line,
leaving no process and no scratch folder; a --k that lists no neighbour is a one-line usage error."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import ROOT

# compare runs a driver that makes graph building fail. cli.main always opens the second process (Pool(), enabled at
# every size), and its first task, the untied head's reference, answers 4 x vocab logits and their bounds (about 70
# bytes a token): from 16384 tokens that is over a megabyte, written in pipe-sized pieces. The builder fails as soon
# as a result starts to arrive, so the worker is ended part-way through sending it: the executor's manager thread
# is left reading a message that never ends, which close() used to join (7 of 10 runs hung at 16384 x 16 before the
# fix, 1 of 10 at 4096 x 16). Where the pool's insides are not what this expects, the builder fails at once.
DRIVER = textwrap.dedent('''
    import sys

    import embed
    import runtime.compare.pool
    import runtime.compare.sessions
    from runtime.compare import main

    WAIT = 0.0  # seconds to wait for a result to start arriving (0: fail at once): the first argument
    pools = []
    opened = runtime.compare.pool.Pool.__init__


    def remember(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        pools.append(self)


    def broken(*args):
        results = getattr(getattr(pools[-1], "_executor", None), "_result_queue", None) if pools else None
        if WAIT and results is not None:
            results._reader.poll(WAIT)
        raise RuntimeError("graph building failed")


    runtime.compare.pool.Pool.__init__ = remember
    runtime.compare.sessions.build_all = broken


    def run(argv):
        try:
            return main(argv)
        except RuntimeError as e:
            print(f"driver: {e}", file=sys.stderr)
            return 1


    if __name__ == "__main__":  # the second process imports this file again (forkserver), as __mp_main__
        WAIT = float(sys.argv.pop(1))
        embed.run_cli(run, prog="driver")
''')


def session_processes(sid):
    """Live (not zombie) processes of session `sid`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, session
            found.append(int(pid))
    return found


def failing_compare(tmp_path, vocab, width, wait, timeout=30, env=None):
    """Run the driver in a session of its own; (exit status, stdout, stderr), after asserting that it ended within
    `timeout` and left no process and no scratch folder (pymp-*: multiprocessing's; onnx-lab-compare-*: its own)."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    process = subprocess.Popen([sys.executable, str(driver), str(wait), "--vocab-size", str(vocab), "--width",
                                str(width), "--format", "float32"], cwd=ROOT, text=True, start_new_session=True,
                               env=dict(os.environ, TMPDIR=str(scratch), **(env or {}),
                                        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # it, the forkserver and the worker: one process group
        out, err = process.communicate()
        pytest.fail(f"compare hung after graph building failed ({vocab} x {width}): {err[-2000:]}")
    deadline = time.monotonic() + 10  # the forkserver and resource tracker end once they read its exit
    while session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = session_processes(process.pid)
    if left:
        os.killpg(process.pid, signal.SIGKILL)
    assert not left, f"processes left: {left}"
    assert [n for n in os.listdir(scratch) if n.startswith(("onnx-lab-", "pymp-", "tmp"))] == []  # (onnxruntime's
    # import writes .ses there)
    return process.returncode, out, err


def ended_in_one_line(code, out, err):
    return (code == 1 and err == "driver: graph building failed\n" and "Traceback" not in out
            and out.startswith("embedding-onnx-lab compare:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts processes by session in /proc")
@pytest.mark.parametrize("run", range(6))
def test_a_failed_build_ends_while_the_second_process_sends(tmp_path, run):
    start = time.monotonic()
    code, out, err = failing_compare(tmp_path, 16384, 16, wait=20)
    assert ended_in_one_line(code, out, err), (code, out, err)
    assert time.monotonic() - start < 30


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts processes by session in /proc")
def test_a_failed_build_at_the_size_reported_ends(tmp_path):
    # issue 29: 300000 x 16, failing as soon as graph building starts; GLIBC_TUNABLES already set keeps compare
    # from re-running itself on huge pages, in a child that would not have the broken builder
    code, out, err = failing_compare(tmp_path, 300000, 16, wait=0, timeout=60,
                                     env={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert ended_in_one_line(code, out, err), (code, out, err)


@pytest.mark.parametrize("k", ["0", "-1", "-9", str(2**63)])
def test_compare_k_outside_its_range_is_a_usage_error(k):
    done = subprocess.run([sys.executable, "-m", "runtime.compare", "--vocab-size", "64", "--width", "8", "--k", k],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    why = (f"at most 2**63 - 1 (an int64), got {k}; any k above --vocab-size - 1 = 63 lists all 63 other tokens"
           if int(k) > 0 else f"at least 1 (the neighbours each list holds), got {k}")
    assert done.stderr == f"python -m runtime.compare: error: --k must be {why}\n"


def test_compare_k_above_the_others_lists_them_all(capsys):
    from runtime import compare
    code = compare.main(["--vocab-size", "64", "--width", "8", "--format", "float32", "--k", "1000"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL", "N/A"))]
    assert code == 0 and all(line.startswith("PASS") for line in lines), out
    neighbors = [line for line in lines if "| neighbors " in line]
    # what it really lists, not the k asked for (#32: `--k 5000` on 4096 rows said `top 5000`)
    assert len(neighbors) == 2 and all("all 63 others of token 0" in line for line in neighbors)
    assert "1000" not in out
    assert compare.parse(["--vocab-size", "64", "--k", "1"]).k == 1
