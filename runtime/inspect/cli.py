"""The command: python -m runtime.inspect MODEL.onnx|FOLDER [--json] [--retie OUT.onnx] [--check] [--files A,B]
[--dtype NAME] [--timeout S] [--memory-limit GiB]."""
import errno
import json
import os
import sys
import tempfile

import graphs
from graphs.outputs import check_output, check_utf8
from embed import Terminated, UsageError, raise_on_sigterm, run_cli
from runtime.inspect import answer, usage
from runtime.inspect.analysis import analyse
from runtime.model.read.layout import client_files
from runtime.model.read.text import InspectError, printable
from runtime.inspect.report import as_json, folder_json, folder_report, report, variants_json, variants_report
from runtime.inspect.retie import quality
from runtime.inspect.retie.folder import retie_folder
from runtime.inspect.retie.rules import LOOKUP_FROM_HEAD, SHARED_INT8, Lossy
from runtime.inspect.retie.variants import retie_variants
from runtime.inspect.retie.write import Asked, retie
from runtime.inspect.sandbox import guard, isolated
from runtime.progress import Progress


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


def _check_out_folder(out, model):
    """--retie OUT for a FOLDER: a new folder, beside or anywhere but inside the model's, that can be made."""
    if not out or os.path.lexists(out):
        raise InspectError(f"--retie {out!r}: exists; for a folder OUT names a new folder to make (nothing is "
                           "overwritten)" if out else "--retie needs a folder name for OUT, got ''")
    inside = os.path.realpath(os.path.dirname(os.path.abspath(out)))
    if os.path.commonpath([inside, os.path.realpath(model)]) == os.path.realpath(model):
        raise InspectError(f"--retie {out}: inside the model's folder; name a folder elsewhere")
    try:
        check_output(out.rstrip(os.sep) or out, "--retie OUT")  # UTF-8, its parent there, writable
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
        check_output(out, "--retie OUT")  # UTF-8, its folder there and writable
    except ValueError as e:
        raise InspectError(str(e)) from None
    folder = os.path.dirname(os.path.abspath(out))
    space = os.statvfs(folder)
    if space.f_bavail * space.f_frsize == 0:
        raise InspectError(f"{folder}: no space left for OUT")


def _writer(stream, progress=None):
    """stream.write with every line made printable (names in the model are untrusted text) and wrapped at
    answer.WIDTH, the progress line cleared first."""
    def write(text):
        if progress is not None:
            progress.done()
        stream.write(answer.line(text))
    return write


def _streams():
    """Standard error reopened on /dev/null if closed, and names either stream cannot show escaped."""
    if sys.stderr is None:  # closed (`2>&-`): errors go nowhere, the exit status still says
        sys.stderr = open(os.devnull, "w")
    for stream in (sys.stdout, sys.stderr):  # a name an ASCII terminal cannot show is escaped, not an error
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, LookupError, ValueError):  # not a text stream, or an encoding without it (idna)
            pass


def _checked(args, verdict):
    """The exit status of a run without --retie: with --check, 1 where the verdict holds a failing kind, its lines
    at the end of the report (stdout; stderr under --json, whose stdout is the JSON alone)."""
    if not args.check:
        return 0
    lines = answer.check_lines(verdict)
    for text in lines:
        print(answer.line(text), file=sys.stderr if args.json else sys.stdout)
    return 0 if lines[-1].startswith("--check: passed") else 1


def _check_args(args, prog):
    """UsageError (or InspectError) for options that cannot go together, or an OUT that cannot be written."""
    check_utf8(args.model, "MODEL's path")
    if args.files and not os.path.isdir(args.model):
        raise UsageError(f"{prog}: error: --files chooses files of a FOLDER; {args.model} is not one")
    if args.dtype is not None and args.files:
        raise UsageError(f"{prog}: error: --files and --dtype both choose the files to inspect; give one of them")
    if args.dtype is not None and not os.path.isdir(args.model):
        raise UsageError(f"{prog}: error: --dtype chooses a variant of a transformers.js FOLDER; {args.model} is "
                         "not a folder")
    if args.dtype is not None:
        try:
            client_files(args.model, dtype=args.dtype)  # InspectError naming the dtypes the folder has
        except OSError as e:  # a folder that cannot be listed
            raise InspectError(f"{e.filename or args.model}: {e.strerror or e}") from None
    if args.static and args.retie is not None:
        raise UsageError(f"{prog}: error: --retie proves its rewrite in onnxruntime; give it without --static")
    if args.static and args.time_prefill:
        raise UsageError(f"{prog}: error: --time-prefill runs a prefill in onnxruntime; give it without --static")
    if args.check and args.retie is not None:
        raise UsageError(f"{prog}: error: --check judges the model as it is; give it without --retie")
    if args.logits_to_keep is not None and args.retie is None:
        raise UsageError(f"{prog}: error: --logits-to-keep is a rewrite --retie makes; give it with --retie OUT")
    if args.lookup_from_head and args.retie is None:
        raise UsageError(f"{prog}: error: --lookup-from-head is a rewrite --retie makes; give it with --retie OUT")
    if args.shared_int8 and args.retie is None:
        raise UsageError(f"{prog}: error: --shared-int8 is a rewrite --retie makes; give it with --retie OUT")
    if args.shared_int8 and args.lookup_from_head:
        raise UsageError(f"{prog}: error: --lookup-from-head and --shared-int8 are two ways to keep one table; give "
                         "one of them")
    for flag, given in (("--text", args.text), ("--reference", args.reference)):
        if given is not None and not (args.lookup_from_head or args.shared_int8):
            raise UsageError(f"{prog}: error: {flag} measures the price of a --retie that changes values; give it "
                             "with --retie OUT --lookup-from-head or --shared-int8")
    if args.text is not None:
        args.text = quality.checked_text(args.text)
    if args.reference is not None and not os.path.exists(args.reference):
        raise UsageError(f"{prog}: error: --reference {args.reference}: no such file or folder")
    if args.retie is not None:
        (_check_out_folder if os.path.isdir(args.model) else _check_out)(args.retie, args.model)


def main(argv=None, supervised=True):
    """The command; its exit status. `supervised`: run the work in guard's forked worker, as the command does (False
    runs it in this process, for a caller that captures sys.stdout in-process; no SIGBUS or whole-command deadline
    protection then)."""
    parser = usage.parser()
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
    limits = isolated.Limits(args.timeout, memory, progress, guard.committing, proving=args.retie is not None)
    said = _Held(sys.stderr) if args.json else sys.stdout  # a retie's lines: stdout holds the report, or the JSON
    try:
        if not args.static:  # its child imports onnxruntime while this process reads and checks the model
            isolated.prestart(folder)
        analysis = analyse(args, folder, limits)
        progress.done()
        if args.retie is None or not args.json:
            _render(analysis, args)
        if args.retie is None:
            return _checked(args, analysis.verdict)
        lossy = (Lossy(LOOKUP_FROM_HEAD) if args.lookup_from_head else Lossy(SHARED_INT8) if args.shared_int8
                 else None)
        retied = {"out": args.retie, "status": None, "lookup_from_head": [] if lossy else None}
        qualities = []
        try:  # with --json, the document follows the retie: its record is part of it
            retied["status"] = _retie(analysis, args, folder, limits, _writer(said, progress),
                                      Asked(args.logits_to_keep, lossy, retied["lookup_from_head"],
                                            args.text, args.reference, qualities))
            return _released(said, retied["status"])
        finally:
            progress.done()
            if args.json:
                retied["quality"] = (qualities[0] if qualities else None) if analysis.kind == "file" else qualities
                _render(analysis, args, retied)
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
        isolated.let_go_ahead()
        progress.done()


def _render(analysis, args, retied=None):
    """The report of `analysis` on stdout: its text, or the --json document (with `retied`, --retie's record:
    {"out", "status" (None where it stopped with an error), "lookup_from_head"})."""
    kind, found = analysis.kind, analysis.found
    if args.json:  # json.dumps escapes every control and non-ASCII character itself
        document = {"file": lambda: as_json(found, args.model), "folder": lambda: folder_json(found),
                    "variants": lambda: variants_json(args.model, found)}[kind]()
        if retied is not None:
            document["retie"] = retied
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    elif kind == "file":
        report(found, args.model, sys.stdout, args.verbose)
    elif kind == "folder":
        folder_report(found, sys.stdout, args.verbose)
    else:
        variants_report(args.model, found, sys.stdout, args.verbose)


def _retie(analysis, args, scratch, limits, say, asked):
    """--retie OUT of what `analysis` found, as `asked` (write.Asked); the retie's status (0 or 1). A transformers.js
    folder, unless --dtype or --files chooses its files, is retied variant by variant; any other folder as the files
    a client loads."""
    kind, found = analysis.kind, analysis.found
    isolated.prestart(scratch)  # the proof's child imports onnxruntime while OUT is written
    if kind == "file":
        return retie(found.model, found, args.retie, scratch, limits, say, asked)
    if kind == "folder":
        return retie_folder(found, args.retie, scratch, limits, say, asked)
    return retie_variants(found, args.retie, scratch, limits, say, asked)


def _released(said, status):
    """`status`, a retie's own (0 or 1), once its held lines (--json) are on stderr."""
    if isinstance(said, _Held):
        said.release()
    return status


def console():
    """The `onnx-lab-inspect` command an install gives (pyproject.toml)."""
    run_cli(main)
