"""The command: parse, run every check in order, print one line each, write JSON."""
import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict

import onnx
import onnxruntime as ort

import embed
import graphs
from runtime.compare.formats import check_formats
from runtime.compare.heads import check_self_score, check_tied, check_untied
from runtime.compare.bounds import U
from runtime.compare.lab import Lab, Progress
from runtime.compare.lookups import check_gather, check_onehot, check_scaled, check_table
from runtime.compare.neighbours import check_neighbors
from runtime.compare.sizes import check_sizes

CHECKS = [check_table, check_gather, check_onehot, check_tied, check_untied, check_neighbors, check_scaled,
          check_self_score, check_formats, check_sizes]  # sizes last: it runs in the second process meanwhile
EARLY = [check_formats]  # run first, reported in CHECKS' order
MAX_VALUES = 2**26  # the reference is pure Python: 67M values is minutes of it


class UsageError(Exception):
    """Bad usage or input: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: error: {message}")


def parse(argv, description=""):
    parser = _Parser(prog="python -m runtime.compare", description=description)
    add = parser.add_argument
    add("--vocab-size", type=int, default=4096, help="rows in the table (default 4096)")
    add("--width", type=int, default=96, help="values per row (default 96; sqrt(96) is not a float32)")
    add("--seed", type=int, default=0, help="table seed; the untied head uses seed+1, hidden vectors seed+2")
    add("--ids", type=embed.parse_ids, default=[3, 3, 17], help="ids to look up (default 3,3,17)")
    add("--query", type=int, default=0, help="token whose neighbours are checked (default 0)")
    add("--k", type=int, default=8, help="neighbours to list (default 8)")
    add("--stretch", type=int, help="token whose row is stretched (default: the query's best dot neighbour "
                                    "that does not already lead)")
    add("--factor", type=float, help="stretch factor (default: the smallest power of two that makes it lead)")
    add("--format", default="all", metavar="FMT[,FMT...]",
        help=f"formats to check besides float32: 'all' (default) or a comma list of {', '.join(embed.FORMATS)}")
    add("--block-size", type=int, default=32,
        help="int8 / int4: columns per scale (default 32; int4 lookups need a power of two >= 16)")
    add("--json", metavar="PATH|-", help="write the results as JSON ('-': standard output, the report to stderr)")
    add("--export", metavar="DIR", help="also write the seven graphs there (never overwrites)")
    args = parser.parse_args(argv)
    try:
        embed.param_count(args.vocab_size, args.width)
        if args.vocab_size < 2:
            raise ValueError(f"--vocab-size must be >= 2, got {args.vocab_size}")
        if args.vocab_size * args.width > MAX_VALUES:
            raise ValueError(f"--vocab-size x --width must be <= {MAX_VALUES} (the reference is pure Python)")
        if not args.ids:
            raise ValueError("--ids needs at least one id")
        embed.check_ids(args.ids + [args.query] + ([args.stretch] if args.stretch is not None else []),
                        args.vocab_size)
        embed.check_int("k", args.k, 0)
        if args.factor is not None:
            embed.check_factor(args.factor)
        if args.stretch == args.query:
            raise ValueError(f"--stretch {args.stretch} is the query itself; pick another token")
        args.formats = embed.FORMATS if args.format == "all" else tuple(dict.fromkeys(args.format.split(",")))
        for fmt in args.formats:
            graphs.precision.check_graph_format(fmt, args.block_size if fmt in ("int8", "int4") else None,
                                                args.width)
        if args.export and os.path.exists(args.export) and not os.path.isdir(args.export):
            raise ValueError(f"--export {args.export} exists and is not a folder")
        if args.export:
            taken = [name for name in graphs.export.FILES if os.path.lexists(os.path.join(args.export, name))]
            if taken:
                raise ValueError(f"--export: {os.path.join(args.export, taken[0])} exists; refusing to overwrite")
    except (TypeError, ValueError, IndexError) as e:
        parser.error(str(e))
    return args


HUGE_PAGES = "glibc.malloc.hugetlb=1"
HUGE_FROM = 2**22  # table values from which the re-run pays: its imports cost about 0.4 s


def huge_pages_env(argv, environ=os.environ):
    """The environment to re-run a large compare in (the command, not main(), does so), or None.

    glibc's malloc serves every large block (a table's bytes in a protobuf, onnxruntime's buffers) from a fresh
    mapping of 4 KiB pages, each faulted in and zeroed on first touch: at 50257 x 768 that was 5.2 million page
    faults and 18-22 s of system time. The tunable glibc.malloc.hugetlb=1 (glibc 2.35 and later; others ignore it)
    makes malloc ask for transparent huge pages instead: 0.54 million faults, 13 s. glibc reads it at start-up only.
    """
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or not sys.executable or "glibc.malloc.hugetlb" in tunables:
        return None
    try:
        args = parse(argv)
    except UsageError:  # main reports it
        return None
    if args.vocab_size * args.width < HUGE_FROM:
        return None
    return dict(environ, GLIBC_TUNABLES=":".join(filter(None, [tunables, HUGE_PAGES])))


def _write_json(path, data):
    text = json.dumps(data, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".compare-", suffix=".json", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)


def main(argv=None, description=""):
    try:
        args = parse(argv, description)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    report = sys.stderr if args.json == "-" else sys.stdout
    progress = Progress(enabled=args.json != "-")
    with tempfile.TemporaryDirectory(prefix="onnx-lab-compare-") as folder:
        lab = Lab(args, folder, progress, background=[check_sizes])
        try:
            progress.done()
            print(f"embedding-onnx-lab compare: vocab {lab.vocab}, width {lab.width}, seed {lab.seed}, ids {lab.ids}, "
                  f"query {lab.query}, k {lab.k}; onnxruntime {ort.__version__}, onnx {onnx.__version__}", file=report)
            checks, early = [], {}
            for run_check in EARLY:  # needs nothing from the second process, which meanwhile makes what others need
                progress(run_check.__name__.replace("check_", "checking "))
                early[run_check] = run_check(lab)
            for run_check in CHECKS:
                progress(run_check.__name__.replace("check_", "checking "))
                if run_check in early:
                    found = early.pop(run_check)
                else:
                    found = lab.result(run_check.__name__) if run_check is check_sizes else run_check(lab)
                progress.done()
                for check in found:
                    checks.append(check)
                    print(check.line(), file=report, flush=True)
            if args.export:
                os.makedirs(args.export, exist_ok=True)
                for name, model in lab.models.items():
                    graphs.save(model, os.path.join(args.export, name))
                print(f"wrote {len(lab.models)} graphs to {args.export}", file=report)
        finally:
            lab.close()
            progress.done()
    failed = sum(c.passed is False for c in checks)
    figures = sum(c.figure for c in checks)
    skipped = sum(c.passed is None for c in checks) - figures
    print(f"{len(checks) - failed - skipped - figures} passed, {failed} failed, {skipped} not applicable "
          f"({figures} figures)", file=report)
    if args.json:
        config = {"vocab_size": lab.vocab, "width": lab.width, "seed": lab.seed, "ids": lab.ids, "query": lab.query,
                  "k": lab.k, "formats": list(lab.formats), "block_size": lab.block_size, "stretch": lab.stretch, "factor": lab.factor, "onnxruntime": ort.__version__,
                  "onnx": onnx.__version__, "u": U}
        _write_json(args.json, {"passed": failed == 0, "config": config, "checks": [asdict(c) for c in checks]})
    return 1 if failed else 0
