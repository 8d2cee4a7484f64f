"""python -m graphs.export DIR: write the lab's seven graphs as .onnx files, ready to open in Netron."""
import os
import sys

from embed import FORMATS, OneLineParser, UsageError, check_fits, run_cli  # argparse with one-line errors, exit 2
from graphs.precision import ACCURACY_LEVELS
from graphs import serve
from graphs.builders import gather_lookup, neighbors, onehot_lookup, scaled_lookup, tied_logits, untied_logits
from graphs.outputs import check_folder
from graphs.storage import data_path, save
from graphs.table import make_table

MIN_VOCAB = 2  # the neighbours graphs rank the tokens other than a query: there must be one (compare says the same)
BLOCK_SIZE = 32  # int8 / int4 columns per scale, by default: compare's, the bench's and MatMulNBits' usual block
COPIES = 10  # float32 tables held at once: the table and the untied head, and in the graphs' protos 8 more

FILES = ["gather_lookup.onnx", "onehot_lookup.onnx", "tied_logits.onnx", "untied_logits.onnx",
         "scaled_lookup.onnx", "neighbors_cosine.onnx", "neighbors_dot.onnx"]


def build_all(vocab_size, width, seed, fmt="float32", block_size=None, accuracy_level=4):
    """{file name: model} for every graph; the table is embed.make_table(V, D, S), the untied head seed S+1, each
    stored in `fmt` (graphs.precision); int8 / int4 heads at `accuracy_level`."""
    table = make_table(vocab_size, width, seed)
    head = make_table(vocab_size, width, seed + 1)
    at = {} if (fmt, block_size) == ("float32", None) else {"fmt": fmt, "block_size": block_size}
    level = {} if accuracy_level == 4 else {"accuracy_level": accuracy_level}
    models = [gather_lookup(table, **at), onehot_lookup(table, **at), tied_logits(table, **at, **level),
              untied_logits(table, head, **at, **level), scaled_lookup(table, **at), neighbors(table, "cosine", **at),
              neighbors(table, "dot", **at)]
    return dict(zip(FILES, models))


def check_size(vocab_size, width):
    """ValueError (one line, naming the option) unless the table is one the lab's graphs can be built on: the
    smallest vocabulary and width graphs.export and compare both take."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"--vocab-size must be >= {MIN_VOCAB} (the neighbours graphs rank the tokens other than the "
                         f"query), got {vocab_size}")
    if width < 1:
        raise ValueError(f"--width must be >= 1, got {width}")


def _parser():
    parser = OneLineParser(prog="python -m graphs.export", description=__doc__.split(": ", 1)[1], epilog=(
        "DIR is created if missing (as compare's --export DIR); a file of these names already there is refused "
        "unless --force. Refusals are one line, 'PROG: error: ...', exit 2."))
    parser.add_argument("dir", metavar="DIR", help="folder to write into (created if missing)")
    parser.add_argument("--vocab-size", type=int, default=256, help=f"rows in the table, >= {MIN_VOCAB}: the neighbours "
                        "graphs rank a query's other tokens (default 256)")
    parser.add_argument("--width", type=int, default=32, help="values per row, >= 1 (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="table seed; the untied head uses seed+1 (default 0)")
    parser.add_argument("--format", default="float32", choices=FORMATS, help="how the tables are stored "
                        "(default float32)")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help=f"int8 / int4: columns per scale (default "
                        f"{BLOCK_SIZE}, as compare's; the width, for one scale a row; int4 lookups need a power of two "
                        ">= 16); the float formats have no scales and ignore it")
    parser.add_argument("--accuracy-level", type=int, choices=ACCURACY_LEVELS, default=4,
                        help="int8 / int4 heads in the block layout (MatMulNBits): 4 (default) also quantizes the "
                             "hidden vector to int8 per block, 0 multiplies in float32")
    parser.add_argument("--force", action="store_true", help="replace files that already exist")
    parser.add_argument("--netron", action="store_true", help="then serve the graphs in Netron, one address each "
                        "(printed), until Ctrl-C")
    parser.add_argument("--port", type=int, default=serve.DEFAULT_PORT, help=f"--netron: the first graph's port, the "
                        f"others on the ports after it (default {serve.DEFAULT_PORT}; 0: free ports the system picks)")
    return parser


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        check_folder(args.dir, "DIR")  # a folder (or one to make) that can be written, UTF-8
        check_size(args.vocab_size, args.width)
        check_fits(COPIES * 4 * args.vocab_size * args.width, f"--vocab-size {args.vocab_size} x --width {args.width}")
        if args.netron:  # before anything is written
            serve.check_netron()
            serve.check_ports(args.port, len(FILES))
    except (UsageError, ValueError) as e:
        parser.error(str(e))
    block_size = args.block_size if args.format in ("int8", "int4") else None
    paths = [os.path.join(args.dir, name) for name in FILES]
    taken = [p for p in paths + [data_path(p) for p in paths] if os.path.lexists(p)]
    if taken and not args.force:
        parser.error(f"{taken[0]} exists (and {len(taken) - 1} more); use --force to replace")
    try:
        models = build_all(args.vocab_size, args.width, args.seed, args.format, block_size, args.accuracy_level)
    except (TypeError, ValueError) as e:  # a block size the format cannot take
        parser.error(str(e))
    try:
        os.makedirs(args.dir, exist_ok=True)
        for path, model in zip(paths, models.values()):
            for written in save(model, path, overwrite=args.force):
                print(f"{written}  {os.path.getsize(written)} bytes")
    except BrokenPipeError:
        raise  # whoever read our output stopped: run_cli ends quietly
    except OSError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.netron:
        try:
            return serve.serve(paths, args.port)
        except OSError as e:  # a port taken since it was checked
            print(f"{parser.prog}: error: --netron: {e}", file=sys.stderr)
            return 2
    return 0


def console():
    """The `onnx-lab-export` command an install gives (pyproject.toml)."""
    run_cli(main)


if __name__ == "__main__":
    run_cli(main, prog="python -m graphs.export")
