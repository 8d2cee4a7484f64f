"""What one compare run is asked: the command line, checked once, as a frozen Config."""
import dataclasses
import os
import sys

import embed
import graphs
from graphs.outputs import check_folder, check_output
from embed import OneLineParser

MAX_VALUES = 2**26  # the reference is pure Python: 67M values is minutes of it
MAX_K = 2**63 - 1  # the neighbours graphs' k input is an int64
FACTORS = (2.0**-30, 2.0**30)  # a stretch factor keeps a row's float32 squares normal and finite


@dataclasses.dataclass(frozen=True)
class Config:
    """One run's settings. `stretch` and `factor` are what the user asked (None: the Reference picks them)."""
    vocab: int = 4096
    width: int = 96
    seed: int = 0
    ids: tuple = (3, 3, 17)
    query: int = 0
    k: int = 8
    stretch: int | None = None
    factor: float | None = None
    formats: tuple = embed.FORMATS
    block_size: int = 32
    accuracy_level: int = 4
    json: str | None = None
    export: str | None = None
    verbose: bool = False

    def listed(self):
        """What the neighbour checks list, in words: 'top k', or every other token where k reaches vocab - 1."""
        return f"top {self.k}" if self.k < self.vocab - 1 else f"all {self.vocab - 1} others"

    def block_for(self, fmt):
        """The block size `fmt` is stored with: --block-size for int8 / int4, None for the float formats."""
        return self.block_size if fmt in ("int8", "int4") else None

    def as_dict(self):
        return {"vocab_size": self.vocab, "width": self.width, "seed": self.seed, "ids": list(self.ids),
                "query": self.query, "k": self.k, "formats": list(self.formats), "block_size": self.block_size,
                "accuracy_level": self.accuracy_level}


def parser(description=""):
    p = OneLineParser(prog="python -m runtime.compare", description=description,
                      epilog="Above 4M table values the command re-runs itself once with glibc's malloc on huge pages "
                             "(GLIBC_TUNABLES=glibc.malloc.hugetlb=1): far fewer page faults for the same work.")
    add = p.add_argument
    add("--model", metavar="PATH", help="run the lab on a real model's token table instead: an ONNX file or folder "
                                        "(anything inspect reads), or a GGUF file (needs the optional gguf package)")
    add("--table", metavar="NAME", help="--model: the token table to read where the model has several")
    add("--plot", metavar="FILE.png", help="--model: draw the row lengths and each query's two lists (needs "
                                           "matplotlib)")
    add("--verify-under-trained", type=int, metavar="N",
        help="--model: run the model (an ONNX decoder) on the N top under-trained candidates, asking it to repeat "
             "each; under 1%% probability of doing so confirms one")
    add("--vocab-size", type=int, default=4096, help=f"rows in the table, >= {graphs.export.MIN_VOCAB}: the neighbour "
                                                     "checks rank a query's other tokens (default 4096)")
    add("--width", type=int, default=96, help="values per row (default 96; sqrt(96) is not a float32)")
    add("--seed", type=int, default=0, help="table seed; the untied head uses seed+1, hidden vectors seed+2")
    add("--ids", type=embed.parse_ids, default=[3, 3, 17], help="ids to look up (default 3,3,17)")
    add("--query", default="0", metavar="Q[,Q...]",
        help="token whose neighbours are checked (default 0); with --model, ids or texts the model's tokenizer makes "
             "into one token each (default: ' Paris', ' king', ' water' where each is one token)")
    add("--k", type=int, default=8, help="neighbours to list, >= 1 (default 8; above vocab-size - 1: all "
                                          "the others)")
    add("--stretch", type=int, help="token whose row is stretched (default: the query's best dot neighbour "
                                    "that does not already lead)")
    add("--factor", type=float, help="stretch factor (default: the smallest power of two that makes it lead)")
    add("--format", default="all", metavar="FMT[,FMT...]",
        help=f"formats to check besides float32: 'all' (default) or a comma list of {', '.join(embed.FORMATS)}")
    add("--block-size", type=int, default=graphs.export.BLOCK_SIZE,
        help=f"int8 / int4: columns per scale (default {graphs.export.BLOCK_SIZE}, as graphs.export's; int4 lookups need "
             "a power of two >= 16)")
    add("--accuracy-level", type=int, choices=graphs.precision.ACCURACY_LEVELS, default=4,
        help="int8 / int4 heads (MatMulNBits): 4 (default, the fastest) quantizes the hidden vector to int8 per block "
             "too, 0 multiplies it in float32 with the decoded codes; the head is checked against that level's bound")
    add("--json", metavar="PATH|-", help="write the results as JSON ('-': standard output, the report to stderr)")
    add("--export", metavar="DIR", help="also write the seven graphs there (created if missing; never overwrites)")
    add("--verbose", action="store_true", help="under each check's line, the figures behind it: what was measured, "
                                               "the difference and its tolerance (a FAIL line always shows them)")
    return p


def check_export(folder):
    """ValueError unless the lab's graphs can be written into `folder` (made if missing) without replacing
    anything: checked before the run, not after minutes of it."""
    check_folder(folder, "--export")
    names = list(graphs.export.FILES) + [graphs.storage.data_path(n) for n in graphs.export.FILES]
    taken = [name for name in names if os.path.lexists(os.path.join(folder, name))]
    if taken:
        raise ValueError(f"--export: {os.path.join(folder, taken[0])} exists; refusing to overwrite")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """compare --model's settings: `queries` as given (ids or texts; None: the defaults), `ids` to look up (None:
    the queries')."""
    model: str
    table: str | None = None
    queries: tuple | None = None
    ids: tuple | None = None
    k: int = 8
    json: str | None = None
    plot: str | None = None
    verbose: bool = False
    verify: int | None = None

    def as_dict(self):
        return {"model": self.model, "table": self.table, "queries": None if self.queries is None else
                list(self.queries), "ids": None if self.ids is None else list(self.ids), "k": self.k,
                "verify_under_trained": self.verify}


_NOT_WITH_MODEL = ("--vocab-size", "--width", "--seed", "--format", "--stretch", "--factor", "--block-size",
                   "--accuracy-level", "--export")  # each describes the generated table


def _given(argv, option):
    return any(a == option or a.startswith(option + "=") for a in argv)


def _model_config(p, args, argv):
    """The ModelConfig of `args` (parsed with --model); UsageError for an option of the generated table."""
    refused = [o for o in _NOT_WITH_MODEL if _given(argv, o)]
    if refused:
        p.error(f"{refused[0]}: not with --model (the model's own table is read; it sets the size, format and values)")
    for option, value in (("--table", args.table), ("--model", args.model)):
        if value is not None and not value:
            p.error(f"{option}: empty")
    if args.k < 1:
        p.error(f"--k must be at least 1 (the neighbours each list holds), got {args.k}")
    if args.verify_under_trained is not None and args.verify_under_trained < 1:
        p.error(f"--verify-under-trained must be at least 1 (the candidates to run), got {args.verify_under_trained}")
    try:
        if args.json not in (None, "-"):
            check_output(args.json, "--json")
        if args.plot is not None:
            check_output(args.plot, "--plot")
            import matplotlib  # noqa: F401  (refused now, not after the run)
    except ValueError as e:
        p.error(str(e))
    except ImportError:
        p.error("--plot needs matplotlib, which is optional: ./lab_env/python -m pip install matplotlib")
    queries = None if not _given(argv, "--query") else tuple(q for q in args.query.split(",") if q)
    if queries == ():
        p.error("--query: empty")
    ids = tuple(args.ids) if _given(argv, "--ids") else None
    return ModelConfig(model=args.model, table=args.table, queries=queries, ids=ids, k=args.k, json=args.json,
                       plot=args.plot, verbose=args.verbose, verify=args.verify_under_trained)


def parse(argv=None, description=""):
    """The Config for `argv` (a ModelConfig with --model), every value checked; a bad one raises UsageError
    (embed.OneLineParser's) with one line naming it."""
    p = parser(description)
    argv = sys.argv[1:] if argv is None else list(argv)
    bad = next((a for a in argv if isinstance(a, str) and any("\udc80" <= c <= "\udcff" for c in a)), None)
    if bad is not None:  # bytes the locale could not decode, kept by Python as lone surrogates
        raise embed.UsageError(f"{p.prog}: error: an argument is not UTF-8 ({os.fsencode(bad)!r:.80}); give it as "
                               "UTF-8 text")
    args = p.parse_args(argv)
    if args.model is not None:
        return _model_config(p, args, argv)
    for option in ("--table", "--plot", "--verify-under-trained"):
        if _given(argv, option):
            p.error(f"{option}: only with --model")
    try:
        try:
            args.query = int(args.query)
        except ValueError:
            raise ValueError(f"--query {args.query!r}: not an id (a text query needs --model and its tokenizer)") \
                from None
        graphs.export.check_size(args.vocab_size, args.width)  # the smallest table export takes too
        if args.vocab_size * args.width > MAX_VALUES:
            raise ValueError(f"--vocab-size x --width must be <= {MAX_VALUES} (the reference is pure Python)")
        if not args.ids:
            raise ValueError("--ids needs at least one id")
        embed.check_ids(args.ids + [args.query] + ([args.stretch] if args.stretch is not None else []),
                        args.vocab_size)
        if args.k < 1:  # 0 would check nothing
            raise ValueError(f"--k must be at least 1 (the neighbours each list holds), got {args.k}")
        if args.k > MAX_K:  # the graphs take k as an int64
            raise ValueError(f"--k must be at most 2**63 - 1 (an int64), got {args.k}; any k above --vocab-size - 1 = "
                             f"{args.vocab_size - 1} lists all {args.vocab_size - 1} other tokens")
        if args.factor is not None:
            embed.check_factor(args.factor)
            if not FACTORS[0] <= args.factor <= FACTORS[1]:  # float32 squares of a stretched row stay normal
                raise ValueError(f"--factor {args.factor:g} is outside [2**-30, 2**30]: the stretched row's float32 "
                                 "squares (the cosine's norms) would overflow or lose their precision")
        if args.stretch == args.query:
            raise ValueError(f"--stretch {args.stretch} is the query itself; pick another token")
        formats = embed.FORMATS if args.format == "all" else tuple(dict.fromkeys(args.format.split(",")))
        for fmt in formats:
            graphs.precision.check_graph_format(fmt, args.block_size if fmt in ("int8", "int4") else None,
                                                args.width)
        if args.json not in (None, "-"):
            check_output(args.json, "--json")
        if args.export is not None:
            check_export(args.export)
    except (TypeError, ValueError, IndexError) as e:
        p.error(str(e))
    return Config(vocab=args.vocab_size, width=args.width, seed=args.seed, ids=tuple(args.ids), query=args.query,
                  k=args.k, stretch=args.stretch, factor=args.factor, formats=formats, block_size=args.block_size,
                  accuracy_level=args.accuracy_level, json=args.json, export=args.export, verbose=args.verbose)
