"""The command: parse, run every check in order, print one line each, write JSON."""
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import asdict

import onnx
import onnxruntime as ort

import embed
from graphs.outputs import write_json
from runtime.bounds import U
from runtime.compare.bounds import WIDTH, summary
from runtime.compare.config import ModelConfig, parse
from runtime.compare.formats import check_formats
from runtime.compare.heads import check_self_score, check_tied, check_untied
from runtime.compare.lookups import check_gather, check_onehot, check_scaled, check_table
from runtime.compare.neighbors import check_neighbors
from runtime.compare.pool import Pool
from runtime.compare.reference import Reference
from runtime.compare.sessions import Sessions
from runtime.compare.sizes import check_sizes
from runtime.progress import Progress

CHECKS = [check_table, check_gather, check_onehot, check_tied, check_untied, check_neighbors, check_scaled,
          check_self_score, check_formats, check_sizes]  # sizes last: its work runs in the second process meanwhile
EARLY = [check_formats]  # run first (they need no pass over the table), reported in CHECKS' order

HUGE_PAGES = "glibc.malloc.hugetlb=1"
HUGE_FROM = 2**22  # table values from which the re-run pays: its imports cost about 0.4 s


def huge_pages_env(config, environ=os.environ):
    """The environment to run a large compare in, or None (small, not Linux, or already set).

    glibc's malloc serves every large block (a table's bytes in a protobuf, onnxruntime's buffers) from a fresh
    mapping of 4 KiB pages, each faulted in and zeroed on first touch: at 50257 x 768 that was 5.2 million page
    faults and 18-22 s of system time. The tunable glibc.malloc.hugetlb=1 (glibc 2.35 and later; others ignore it)
    makes malloc ask for transparent huge pages instead: 0.54 million faults, 13 s. glibc reads it at start-up only,
    so main() runs such a compare in a child process with it set.
    """
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or not sys.executable or "glibc.malloc.hugetlb" in tunables:
        return None
    if config.vocab * config.width < HUGE_FROM:
        return None
    return dict(environ, GLIBC_TUNABLES=":".join(filter(None, [tunables, HUGE_PAGES])))


def _run_child(command, env):
    """Run the compare again in a child and return its status. A signal that ends this process ends the child too
    (it unwinds as this one would: scratch folder and second process removed, one line said), and this waits."""
    child = subprocess.Popen(command, env=env)
    try:
        return child.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the child too; it is told again only if it does not end
        try:
            return child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.terminate()
            return child.wait()
    except embed.Terminated as e:
        child.send_signal(e.signum)
        return child.wait()


def run_checks(config, reference, sessions, report, progress):
    """Every check's lines, printed to `report` as they come."""
    checks, early = [], {}
    for run_check in EARLY:  # needs nothing from the second process, which meanwhile makes what others need
        progress(run_check.__name__.replace("check_", "checking "))
        early[run_check] = run_check(config, reference, sessions)
    for run_check in CHECKS:
        progress(run_check.__name__.replace("check_", "checking "))
        found = early.pop(run_check) if run_check in early else run_check(config, reference, sessions)
        progress.done()
        for check in found:
            checks.append(check)
            print(check.line(), file=report, flush=True)
            if (config.verbose or check.passed is False) and check.details():
                print(check.details(), file=report, flush=True)
    return checks


def _shown(ids, most=8):
    """A list of ids as the header shows it: the first `most`, then how many in all."""
    ids = list(ids)
    return str(ids) if len(ids) <= most else "[" + ", ".join(map(str, ids[:most])) + f", ...] ({len(ids)} ids)"


def header(config):
    """The report's first lines: what this run checks, and with what (wrapped at the report's width)."""
    lines = [f"embedding-onnx-lab compare: table {config.vocab} x {config.width} (vocab x width), seed {config.seed}; "
             f"onnxruntime {ort.__version__}, onnx {onnx.__version__}",
             f"ids {_shown(config.ids)} looked up; neighbours: {config.listed()} of token {config.query}; one line per "
             "check" + ("" if config.verbose else " (--verbose: the figures behind each)")]
    return "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False) for line in lines)


def main(argv=None, description="", impl=embed):
    """Run the checks; 0 all pass, 1 any fails, 2 bad usage. `impl` is the reference implementation (embed)."""
    try:
        config = parse(argv, description)
    except embed.UsageError as e:
        print(e, file=sys.stderr)
        return 2
    if isinstance(config, ModelConfig):
        from runtime.compare.real.cli import run  # a real model's table: its own run
        return run(config)
    env = huge_pages_env(config) if impl is embed else None
    if env is not None:  # once, with glibc's malloc on huge pages (see huge_pages_env)
        args = sys.argv[1:] if argv is None else list(argv)
        return _run_child([sys.executable, "-m", "runtime.compare", *args], env)
    report = sys.stderr if config.json == "-" else sys.stdout
    progress = Progress(enabled=config.json != "-")
    with tempfile.TemporaryDirectory(prefix="onnx-lab-compare-") as folder:
        pool = Pool()
        try:
            reference = Reference(config, pool, impl, progress)
            sessions = Sessions(config, folder, pool, progress)
            progress.done()
            print(header(config), file=report)
            checks = run_checks(config, reference, sessions, report, progress)
            if config.export:
                print(f"wrote the {sessions.export(config.export)} graphs of graphs.export to {config.export}",
                      file=report)
        finally:
            pool.close()
            progress.done()
    failed, line = summary(checks)
    print(line, file=report)
    if config.json:
        data = dict(config.as_dict(), stretch=reference.stretch, factor=reference.factor,
                    onnxruntime=ort.__version__, onnx=onnx.__version__, u=U)
        write_json(config.json, {"passed": failed == 0, "config": data, "checks": [asdict(c) for c in checks]})
    return 1 if failed else 0


def console():
    """The `onnx-lab-compare` command an install gives (pyproject.toml)."""
    embed.run_cli(main)
