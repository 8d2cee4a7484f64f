"""The command: python -m runtime.inspect MODEL.onnx|FOLDER [--json] [--retie OUT.onnx] [--check] [--files A,B]
[--timeout S] [--memory-limit GiB]."""
import argparse
import errno
import json
import os
import sys
import tempfile

import graphs
from embed import OneLineParser, Terminated, UsageError, raise_on_sigterm, run_cli
from runtime.inspect.examine import inspect_model
from runtime.inspect.examine_folder import inspect_folder
from runtime.inspect.findings.across import folder_held_twice, held_twice
from runtime.inspect.read import sidecars
from runtime.inspect.read.text import InspectError, printable
from runtime.inspect.report import as_json, folder_json, folder_report, report
from runtime.inspect.retie.folder import retie_folder
from runtime.inspect.retie.write import retie
from runtime.inspect.sandbox import feeds, guard, isolated
from runtime.progress import Progress

DESCRIPTION = """Find tied, duplicated and runtime-copied tables in an ONNX model, and optionally retie them.

Tables are initializers a Gather or GatherBlockQuantized reads rows from; heads are the weights of a MatMul,
Gemm, FusedMatMul, MatMulNBits or integer matmul (MatMulInteger, DynamicQuantizeMatMul, QLinearMatMul), seen
through Identity, Transpose, Reshape, Cast, Squeeze, Unsqueeze and DequantizeLinear. Each table/head pair of
matching shape is `shared` (one initializer), `duplicate` (same values; quantized: same codes and scales in any
layout), `transposed_duplicate`, `quantized_copy` (one holds the other quantized: not a tie) or `distinct`.
Each vocabulary line gives a table's size, format, tie, and share of the parameters as Hugging Face counts them,
then what a session holds: copies under onnxruntime's default SessionOptions (prepacked ones counted) and with
session.disable_prepacking=1, and the resident bytes one run adds, measured in a fresh child each. Runtime copies
are the initializers onnxruntime's optimized model adds and the copies kernels prepack at load. The model is run
on decoder feeds derived from it (past length at least any sliding window it declares; --proof-past overrides).

A FOLDER is the files a client loads together (genai_config.json's; Optimum's encoder + merged decoder, or the
split decoders; transformers.js's onnx/ layout at one dtype suffix; --files chooses): each file's report, then each
table across the files (where it is stored, who reads it, what one process holding every session keeps) and
config.json's tie_word_embeddings against the graph. Tables and heads inside If / Loop / Scan bodies count too.

--retie writes OUT with each duplicated head, and each head read through a Transpose, a Gemm on its table through
a run-time view nothing prepacks; an int4 lookup reading the head's packed codes in place; and copies
genai_config.json (naming OUT), config and tokenizer files beside OUT. For a FOLDER, OUT is a new folder: every
file retied, all of them naming one data file that holds each table once. It proves the change first (heads within
float32's bound, everything else bit for bit) and never overwrites. The model is untrusted: every tensor is
checked before it is read, external data must lie inside the model's folder, and onnxruntime runs in a child
process under --memory-limit, so a crash there is reported, not suffered; --timeout bounds the whole command."""

EPILOG = """exit status: 0 report written (and OUT, if --retie had something to do); 1 the retie proof failed,
nothing written, or --check found a table held twice or a tie config.json contradicts (or whoever read the report
stopped, as `| head` does); 2 bad usage, a model that cannot be read
safely, or one that cannot be proven on this machine (onnxruntime cannot run the original on the proof's feeds),
or --timeout passed (one line on stderr); 130 / 143 / 129 interrupted, terminated, hung up (nothing left behind)."""


class _Held:
    """A stream whose writes are held until release(): with --json, a retie's lines reach stderr only once it ends
    with a status of its own, so that an error (exit 2) is the one line there."""

    def __init__(self, stream):
        self.stream, self.lines = stream, []

    def write(self, text):
        self.lines.append(text)

    def release(self):
        self.stream.write("".join(self.lines))
        self.lines = []


class _Clean:
    """A stream whose write() makes each line printable."""

    def __init__(self, stream):
        self.write = _writer(stream)


def _positive(text, most=1e6):
    """A positive number of at most `most` (seconds or GiB): beyond that a limit is no limit, and the kernel's and
    Python's own limits overflow."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= most:
        raise argparse.ArgumentTypeError(f"want a positive number up to {most:g}, got {text!r}")
    return value


LEAST_MEMORY = 0.25  # GiB: Python and onnxruntime take about 0.2 GiB of address space before any model


def _memory_limit(text):
    """--memory-limit: GiB, from LEAST_MEMORY (below it no model could be run: the finding would be about the
    limit, not the model) to 1e6."""
    value = _positive(text)
    if value < LEAST_MEMORY:
        raise argparse.ArgumentTypeError(f"want at least {LEAST_MEMORY} GiB (Python and onnxruntime alone take about "
                                         f"0.2 GiB of address space), got {text!r}")
    return value


def _past(text):
    """--proof-past: a whole number of tokens, below sidecars.MOST."""
    if not text.isdigit() or int(text) >= sidecars.MOST:
        raise argparse.ArgumentTypeError(f"want a whole number of tokens from 0 to {sidecars.MOST - 1}, got {text!r}")
    return int(text)


def _names(text):
    """--files: comma-separated file names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"want file names separated by commas, got {text!r}")
    return names


def _check_out_folder(out, model):
    """--retie OUT for a FOLDER: a new folder, beside or anywhere but inside the model's, that can be made."""
    if not out or os.path.lexists(out):
        raise InspectError(f"--retie {out!r}: exists; for a folder OUT names a new folder to make (nothing is "
                           "overwritten)" if out else "--retie needs a folder name for OUT, got ''")
    inside = os.path.realpath(os.path.dirname(os.path.abspath(out)))
    if os.path.commonpath([inside, os.path.realpath(model)]) == os.path.realpath(model):
        raise InspectError(f"--retie {out}: inside the model's folder; name a folder elsewhere")
    try:
        graphs.storage.check_output(out.rstrip(os.sep) or out, "--retie OUT")  # UTF-8, its parent there, writable
    except ValueError as e:
        raise InspectError(str(e)) from None


def _check_out(out, model):
    if not out:
        raise InspectError("--retie needs a file name for OUT, got ''")
    if out.endswith(os.sep) or os.path.isdir(out):
        raise InspectError(f"--retie {out}: a folder; OUT names the model file to write (e.g. {os.path.join(out, 'model.onnx')})")
    if os.path.realpath(out) == os.path.realpath(model):
        raise InspectError("OUT is MODEL: --retie never touches its input; name another file")
    for target in (out, graphs.storage.data_path(out)):
        if os.path.lexists(target):
            raise InspectError(f"{target} exists; refusing to overwrite it")
    try:
        graphs.storage.check_output(out, "--retie OUT")  # UTF-8, its folder there and writable
    except ValueError as e:
        raise InspectError(str(e)) from None
    folder = os.path.dirname(os.path.abspath(out))
    space = os.statvfs(folder)
    if space.f_bavail * space.f_frsize == 0:
        raise InspectError(f"{folder}: no space left for OUT")


def _writer(stream, progress=None):
    """stream.write with every line made printable (names in the model are untrusted text), the progress line
    cleared first."""
    def write(text):
        if progress is not None:
            progress.done()
        stream.write(printable(text))
    return write


def _parser():
    """The command line's parser: every option, with its help."""
    parser = OneLineParser(prog="python -m runtime.inspect", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL.onnx|FOLDER",
                        help="a model file, or the folder a client loads (genai_config.json's files; Optimum's encoder "
                             "and merged decoder; transformers.js's onnx/ layout)")
    parser.add_argument("--files", metavar="A,B", type=_names,
                        help="for a FOLDER: the files (relative to it) to inspect together, instead of the ones its "
                             "layout names")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a table is held more than once (on disk or in memory under onnxruntime's "
                             "defaults) or a tie contradicts config.json, after the report")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--static", action="store_true",
                        help="answer from the files alone, without onnxruntime: tables, heads, pairs and the bytes on "
                             "disk; no runtime copies, nothing counted in memory")
    parser.add_argument("--retie", metavar="OUT.onnx", help="write a copy whose duplicated heads share their table, with the sidecar files its runtime reads")
    parser.add_argument("--timeout", type=_positive, metavar="S",
                        help="wall-clock seconds the whole command may take, onnxruntime's steps included; past them "
                             f"it stops with one line and writes nothing (default {isolated.TIMEOUT:g}, and "
                             f"{isolated.PER_GIB:g} more per GiB of the model's folder past the first)")
    parser.add_argument("--memory-limit", type=_memory_limit, metavar="GiB",
                        help="address space each onnxruntime step may take (default 4 GiB + 6x the model's bytes)")
    parser.add_argument("--proof-past", type=_past, metavar="N",
                        help="past tokens (KV cache length) in the decoder feeds the model is run and proven on "
                             f"(default {feeds.PAST}, or the longest sliding window the model or the "
                             "genai_config.json / config.json beside it declares)")
    return parser


def _streams():
    """Standard error reopened on /dev/null if closed, and names either stream cannot show escaped."""
    if sys.stderr is None:  # closed (`2>&-`): errors go nowhere, the exit status still says
        sys.stderr = open(os.devnull, "w")
    for stream in (sys.stdout, sys.stderr):  # a name an ASCII terminal cannot show is escaped, not an error
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, LookupError, ValueError):  # not a text stream, or an encoding without it (idna)
            pass


def _check_args(args, prog):
    """UsageError (or InspectError) for options that cannot go together, or an OUT that cannot be written."""
    graphs.storage.check_utf8(args.model, "MODEL's path")
    if args.files and not os.path.isdir(args.model):
        raise UsageError(f"{prog}: error: --files chooses files of a FOLDER; {args.model} is not one")
    if args.static and args.retie is not None:
        raise UsageError(f"{prog}: error: --retie proves its rewrite in onnxruntime; give it without --static")
    if args.check and args.retie is not None:
        raise UsageError(f"{prog}: error: --check judges the model as it is; give it without --retie")
    if args.retie is not None:
        (_check_out_folder if os.path.isdir(args.model) else _check_out)(args.retie, args.model)


def main(argv=None, supervised=True):
    """The command; its exit status. `supervised`: run the work in guard's forked worker, as the command does (False
    runs it in this process, for a caller that captures sys.stdout in-process; no SIGBUS or whole-command deadline
    protection then)."""
    parser = _parser()
    _streams()
    raise_on_sigterm()  # SIGTERM unwinds like SIGINT: the scratch folder and a staged OUT go, the child is killed
    try:
        args = parser.parse_args(argv)
        if sys.stdout is None:
            raise InspectError("standard output is closed: the report has nowhere to go")
        _check_args(args, parser.prog)
        if args.timeout is None:
            args.timeout = isolated.default_timeout(args.model)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except (InspectError, ValueError) as e:
        print(printable(f"{parser.prog}: error: {e}"), file=sys.stderr)
        return 2
    if not supervised:
        with tempfile.TemporaryDirectory(prefix="onnx-lab-inspect-") as scratch:
            return _work(args, parser.prog, scratch)
    try:
        scratch = tempfile.mkdtemp(prefix="onnx-lab-inspect-")
    except OSError as e:  # no usable TMPDIR (read-only, full, missing)
        print(printable(f"{parser.prog}: error: no scratch folder: {e.strerror or e}"), file=sys.stderr)
        return 2
    staging = None if args.retie is None else os.path.dirname(os.path.abspath(args.retie))
    return guard.supervise(lambda: _work(args, parser.prog, scratch), args.timeout, scratch, staging, parser.prog,
                           args.retie)


def _work(args, prog, folder):
    """The command itself, in guard's worker: the report, and OUT if --retie; its exit status."""
    memory = None if args.memory_limit is None else int(args.memory_limit * isolated.GiB)
    progress = Progress(enabled=True, clean=printable)  # stderr, on a terminal only; file names escaped
    limits = isolated.Limits(args.timeout, memory, progress, guard.committing)
    said = _Held(sys.stderr) if args.json else sys.stdout  # a retie's lines: stdout holds the report, or the JSON
    try:
        if os.path.isdir(args.model):
            result = inspect_folder(args.model, folder, limits, args.proof_past, args.files, args.static)
            progress.done()
            if args.json:
                sys.stdout.write(json.dumps(folder_json(result), indent=2) + "\n")
            else:
                folder_report(result, _Clean(sys.stdout))
            if args.retie is not None:
                status = retie_folder(result, args.retie, folder, limits, _writer(said, progress))
                return _released(said, status)
            return 1 if args.check and folder_held_twice(result) else 0
        info = inspect_model(args.model, folder, limits, args.proof_past, args.static)
        progress.done()
        say = _writer(said, progress)
        if args.json:  # json.dumps escapes every control and non-ASCII character itself
            sys.stdout.write(json.dumps(as_json(info, args.model), indent=2) + "\n")
        else:
            report(info, args.model, _Clean(sys.stdout))
        if args.retie is None:
            return 1 if args.check and held_twice(info) else 0
        try:
            return _released(said, retie(info["model"], info, args.retie, folder, limits, say))
        finally:
            progress.done()
    except (InspectError, FileExistsError) as e:
        print(printable(f"{prog}: error: {e}"), file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped (| head): end quietly, as run_cli does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # EIO on read, a read-only or full OUT folder or TMPDIR: the system's one line
        if e.errno == errno.EFBIG:  # a write past RLIMIT_FSIZE (Python ignores SIGXFSZ): the shell's, not the model's
            print(f"{prog}: error: a file this command wrote reached the file size limit in force (the shell's "
                  "`ulimit -f`?); raise it and run again (the model is not what failed); nothing written",
                  file=sys.stderr)
            return 2
        where = f"{e.filename}: " if e.filename else ""
        print(printable(f"{prog}: error: {where}{e.strerror or e}"), file=sys.stderr)
        return 2
    except MemoryError:  # the parent's own reading, under a `ulimit -v` from the shell
        print(f"{prog}: error: out of memory reading the model in this process (a shell's `ulimit -v`?); nothing "
              "written", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; no partial file left", file=sys.stderr)
        return 130
    except Terminated as e:
        print(e.line(prog), file=sys.stderr)
        return 128 + e.signum
    finally:
        progress.done()


def _released(said, status):
    """`status`, a retie's own (0 or 1), once its held lines (--json) are on stderr."""
    if isinstance(said, _Held):
        said.release()
    return status


def console():
    """The `onnx-lab-inspect` command an install gives (pyproject.toml)."""
    run_cli(main)
