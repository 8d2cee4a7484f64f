"""`python3 embed.py`: the lab's claims walked through on one table, and the command-line pieces the lab's
other commands share."""
import argparse
import math
import os
import signal
import sys
import threading

from reference.precision import FORMATS, table_bytes
from reference.scores import (check_ids, cosine, dot, lookup, neighbors, norm, onehot_lookup_counted, scale_sqrt_d,
                              stretch_row, stretch_to_lead)
from reference.tables import check_int, make_table, param_count, shape

def _walkthrough(vocab_size, width, seed, ids, query, k):
    """Print the lab's claims, measured on one table."""
    table = make_table(vocab_size, width, seed)
    vocab, width = shape(table)
    print(f"table = make_table({vocab}, {width}, seed={seed}): shape {shape(table)}")
    print(f"  values held: tied {param_count(vocab, width)}, untied {param_count(vocab, width, tied=False)}"
          " (an untied head is a second table)")
    print("  bytes held, tied / untied: " + ", ".join(
        f"{fmt} {table_bytes(vocab, width, fmt)} / {table_bytes(vocab, width, fmt, tied=False)}" for fmt in FORMATS)
        + " (int8 / int4 with one float32 scale a row)")
    doubled = make_table(2 * vocab, width, seed)
    print(f"  vocabulary doubled to {2 * vocab}: tied {param_count(2 * vocab, width)}, untied "
          f"{param_count(2 * vocab, width, tied=False)} (x{param_count(2 * vocab, width) / param_count(vocab, width):g});"
          f" the first {vocab} rows unchanged: {doubled[:vocab] == table}")

    rows = lookup(table, ids)
    hot_rows, multiplications = onehot_lookup_counted(table, ids)
    print(f"\nlookup {ids}: 0 multiplications; one-hot @ table: {multiplications} multiplications "
          f"({len(ids)} x {vocab} x {width})")
    print(f"  same values: {rows == hot_rows}")
    if len(set(ids)) < len(ids):  # an embedding has no context: the row is the same wherever the id stands
        same = all(rows[p] == rows[ids.index(i)] for p, i in enumerate(ids))
        print(f"  a repeated id gives the same vector at every position: {same}")

    print(f"\nneighbours of token {query} (k={k}):")
    by_cosine, by_dot = neighbors(table, query, k), neighbors(table, query, k, "dot")
    print(f"  cosine {by_cosine}\n  dot    {by_dot}")
    candidates = [t for t in neighbors(table, query, vocab, "dot")[1:] if dot(table[t], table[query]) > 0]
    if candidates:
        token = candidates[0]
        factor = stretch_to_lead(table, query, token)
        stretched = stretch_row(table, token, factor)
        after_cosine, after_dot = neighbors(stretched, query, k), neighbors(stretched, query, k, "dot")
        print(f"stretch token {token} (dot rank {neighbors(table, query, vocab, 'dot').index(token) + 1}) "
              f"by {factor:g}:")
        print(f"  cosine {after_cosine} (unchanged: {after_cosine == by_cosine})")
        print(f"  dot    {after_dot} (token {token} leads: {after_dot[:1] == [token]})")
    else:
        print("  no other token has a positive dot product with it, so stretching cannot bring one forward")

    scaled = scale_sqrt_d(table)
    row, row_scaled = table[query], scaled[query]
    print(f"\nscale by sqrt({width}) = {math.sqrt(width):.6f}, row {query}:")
    print(f"  norm {norm(row):.6f} -> {norm(row_scaled):.6f} (ratio {norm(row_scaled) / norm(row):.6f})")
    print(f"  cosine(row, scaled row) = {cosine(row, row_scaled):.9f}")


class UsageError(Exception):
    """Bad usage or input: run_cli prints it as one line on stderr and exits 2 (no traceback)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors raise UsageError, one line (shared by the lab's commands): no usage dump for a
    typo, and a main() called from Python returns 2 rather than exiting. Started as an installed command
    (`onnx-lab-inspect`, pyproject.toml's scripts), it names itself so in its usage and errors."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        command = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        if command.startswith("onnx-lab-"):
            self.prog = command

    def error(self, message):
        shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in message)
        raise UsageError(f"{self.prog}: error: {shown}")  # an argument's control characters escaped, as \x1b


def physical_memory():
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_fits(need, what):
    """UsageError (one line naming the bytes) unless `need` bytes fit in this machine's physical memory: a size
    the command cannot hold is refused before the work, not met by a MemoryError minutes in."""
    have = physical_memory()
    if have is not None and need > have:
        raise UsageError(f"{what} would need about {need} bytes ({need / 2**30:.1f} GiB) of memory; this machine "
                         f"has {have} ({have / 2**30:.1f} GiB)")


PYTHON_VALUE_BYTES = 32  # one value of a reference table: a float object (24 bytes) and the list's pointer to it


def parse_ids(text):
    """'3,3,17' -> [3, 3, 17], for argparse (a one-line ArgumentTypeError otherwise)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"ids must be comma-separated integers, got {text!r}") from None


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the process is, so every `with` and `finally` on the way out runs: scratch
    folders and staged outputs are removed, child processes stopped (see raise_on_sigterm). `signum` says which;
    the exit status is 128 + signum."""

    def __init__(self, signum=signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum

    def line(self, prog):
        """The one line to say, e.g. 'python -m runtime.compare: terminated (SIGTERM); no partial file left'."""
        return f"{prog}: terminated ({signal.Signals(self.signum).name}); no partial file left"


def _terminate(signum, frame):
    for sig in ENDING:  # one is enough: cleaning up is not interrupted by another
        signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # the signals that end a command: each raises, once (runtime.inspect too)
_DEFAULT = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}


def raise_on_sigterm():
    """Make SIGTERM and SIGHUP (the terminal closed) raise Terminated, and SIGINT KeyboardInterrupt as ever, in the
    main thread, each ignoring any further one of them while the first unwinds (a second Ctrl-C cannot cut a
    cleanup short); a signal someone else handles, or ignores (a background job's SIGINT), is left alone."""
    if threading.current_thread() is threading.main_thread():
        for sig in ENDING:
            if signal.getsignal(sig) is _DEFAULT[sig]:
                signal.signal(sig, _terminate)


def run_cli(main, argv=None, prog=None):
    """sys.exit(main(argv)) for a command of the lab (`prog` names it in messages): ending quietly (status 1, no
    traceback) when whoever reads its output stops reading, as `| head` does; on SIGINT (130) or SIGTERM (143)
    with one line, after every cleanup on the way out has run."""
    raise_on_sigterm()
    prog = prog or os.path.basename(sys.argv[0])
    try:
        code = main(argv)
        if sys.stdout is not None:  # None when the descriptor was closed (`>&-`)
            sys.stdout.flush()
    except UsageError as e:
        print(e, file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; no partial file left", file=sys.stderr)
        code = 130
    except Terminated as e:
        print(e.line(prog), file=sys.stderr)
        code = 128 + e.signum
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout again at exit
        code = 1
    sys.exit(code)


def main(argv=None):
    parser = OneLineParser(prog="embed.py", description="Walk through the embedding lab's claims on one table.")
    parser.add_argument("--vocab-size", type=int, default=16, help="rows in the table (default 16)")
    parser.add_argument("--width", type=int, default=8, help="values per row (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="table seed (default 0)")
    parser.add_argument("--ids", type=parse_ids, default=[3, 3, 7], help="ids to look up (default 3,3,7)")
    parser.add_argument("--query", type=int, default=0, help="token whose neighbours are listed (default 0)")
    parser.add_argument("--k", type=int, default=5, help="neighbours to list (default 5)")
    args = parser.parse_args(argv)
    try:
        check_int("vocab_size", args.vocab_size, 2)
        check_int("width", args.width, 1)
        check_int("k", args.k, 0)
        check_ids(args.ids + [args.query], args.vocab_size)
    except (TypeError, ValueError, IndexError) as e:
        parser.error(str(e))
    check_fits(3 * args.vocab_size * args.width * PYTHON_VALUE_BYTES,  # the table, and the table doubled
               f"embed.py: --vocab-size {args.vocab_size} x --width {args.width}")
    _walkthrough(args.vocab_size, args.width, args.seed, args.ids, args.query, args.k)
    return 0
