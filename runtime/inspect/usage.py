"""inspect's command line: its help text, its options and the parsers that check each value."""
import argparse

from embed import OneLineParser
from runtime.model.findings.prefill import PROMPT
from runtime.model.graph import ops
from runtime.model.read import sidecars
from runtime.model.read.layout import DTYPES
from runtime import feeds
from runtime.inspect.sandbox import isolated
from runtime.inspect.retie.quality import SCORED

DESCRIPTION = """Find tied, duplicated and runtime-copied tables in an ONNX model, and optionally retie them.

Tables are initializers a Gather or GatherBlockQuantized reads rows from; heads are the weights of a
{floats} or integer matmul ({integers}),
seen through Identity, Transpose, Reshape, Cast, Squeeze, Unsqueeze and DequantizeLinear. Each table/head pair
of matching shape is `shared` (one initializer), `duplicate` (same values; quantized: same codes and scales in
any layout), `transposed_duplicate`, `quantized_copy` (one holds the other quantized: not a tie) or `distinct`.
The report opens with its verdict: one line per table the files or a client's process hold more than once (copies
on disk and in a session, the bytes wasted, and the fix: --retie OUT, or why none can), or one line saying all is
well; --json holds it as `verdict`. Then each table's size, format, tie and share of the parameters, and what a
session holds: copies under onnxruntime's default SessionOptions (prepacked ones counted) and the resident bytes
one run adds, measured in a fresh child (--verbose: with session.disable_prepacking=1 too, and every detail). A
logits head is a matmul weight whose product reaches a graph output through views, a bias or a scale only. Runtime copies
are the initializers onnxruntime's optimized model adds and the copies kernels prepack at load. The model is run
on decoder feeds derived from it (past length at least any sliding window it declares; --proof-past overrides).

A FOLDER is the files a client loads together (genai_config.json's; Optimum's encoder + merged decoder, or the
split decoders; --files chooses): each file's report, then each table across the files (where it is stored, who
reads it, what one process holding every session keeps) and config.json's tie_word_embeddings against the graph.
Tables and heads inside If / Loop / Scan bodies count too. A transformers.js folder (its root, config.json beside
onnx/, or onnx/ itself) is one such client load per dtype variant (model.onnx, model_fp16.onnx, model_q4.onnx,
model_quantized.onnx, ... each with the files of its suffix): each variant's verdict, then a table of the variants
(files, bytes on disk, copies of the token table on disk and in a session); nothing is counted across variants.
--dtype NAME reports one variant as a folder.

--retie writes OUT with each duplicated head, and each head read through a Transpose, a Gemm on its table through
a run-time view nothing prepacks; an int4 lookup reading the head's packed codes in place; and copies
genai_config.json (naming OUT), config and tokenizer files beside OUT. For a FOLDER, OUT is a new folder: every
file retied, all of them naming one data file that holds each table once; for a transformers.js folder, every
variant (or --dtype's alone), each file with its own onnx/<file>_data, config.json's use_external_data_format
naming them; a variant --retie cannot rewrite is written as it is, and the reason said. It proves the change
first (heads within float32's bound, a float16 / bfloat16 head's within its format's, everything else bit for
bit) and never overwrites. The model is untrusted: every tensor is checked before it is read, external data must
lie inside the model's folder, and onnxruntime runs in a child process under --memory-limit, so a crash there is
reported, not suffered; --timeout bounds the whole command.""".replace("{floats}", ", ".join(ops.FLOAT_MATMULS)).replace(
    "{integers}", ", ".join(ops.INTEGER_MATMULS))  # graph.ops: the one list of matmuls

EPILOG = """exit status:
  0    the report written (and OUT, if --retie had something to do)
  1    the retie proof failed, nothing written; or --check found a table held twice or a tie config.json
       contradicts; or whoever read the report stopped (as `| head` does)
  2    bad usage; a model that cannot be read safely, or that cannot be proven on this machine (onnxruntime
       cannot run the original on the proof's feeds); or --timeout passed (one line on stderr)
  130, 143, 129  interrupted, terminated, hung up (nothing left behind)"""


def positive(text, most=1e6):
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
    value = positive(text)
    if value < LEAST_MEMORY:
        raise argparse.ArgumentTypeError(f"want at least {LEAST_MEMORY} GiB (Python and onnxruntime alone take about "
                                         f"0.2 GiB of address space), got {text!r}")
    return value


def _past(text):
    """--proof-past: a whole number of tokens, below sidecars.MOST."""
    if not text.isdigit() or int(text) >= sidecars.MOST:
        raise argparse.ArgumentTypeError(f"want a whole number of tokens from 0 to {sidecars.MOST - 1}, got {text!r}")
    return int(text)


def _tokens(text):
    """--prompt-length: a whole number of tokens from 1, below sidecars.MOST."""
    if not text.isdigit() or not 0 < int(text) < sidecars.MOST:
        raise argparse.ArgumentTypeError(f"want a whole number of tokens from 1 to {sidecars.MOST - 1}, got {text!r}")
    return int(text)


def _names(text):
    """--files: comma-separated file names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"want file names separated by commas, got {text!r}")
    return names


def parser():
    """The command line's parser: every option, with its help (python -m runtime.inspect --help)."""
    found = OneLineParser(prog="python -m runtime.inspect", description=DESCRIPTION, epilog=EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    found.add_argument("model", metavar="MODEL.onnx|FOLDER",
                        help="a model file, or the folder a client loads (genai_config.json's files; Optimum's encoder "
                             "and merged decoder; transformers.js's root or onnx/, one load per dtype variant)")
    found.add_argument("--files", metavar="A,B", type=_names,
                        help="for a FOLDER: the files (relative to it) to inspect together, instead of the ones its "
                             "layout names")
    found.add_argument("--dtype", metavar="NAME",
                        help="for a transformers.js FOLDER: the one dtype variant to inspect (and --retie), by "
                             f"transformers.js's name: {', '.join(DTYPES)} (q8 is model_quantized.onnx); "
                             "without it every variant the folder has, each on its own")
    found.add_argument("--check", action="store_true",
                        help="exit 1 when a table is held more than once (on disk or in memory under onnxruntime's "
                             "defaults) or a tie contradicts config.json, after the report, whose last line "
                             "then says why (or that it passed)")
    found.add_argument("--json", action="store_true", help="print the findings as JSON (exact bytes; `verdict` first)")
    found.add_argument("--verbose", "-v", action="store_true",
                        help="the detail too: every initializer, distinct pairs, small runtime copies, anonymous and "
                             "file-backed bytes, what a session holds with prepacking off (one run more), and a "
                             "folder's report of each file")
    found.add_argument("--static", action="store_true",
                        help="answer from the files alone, without onnxruntime: tables, heads, pairs and the bytes on "
                             "disk; no runtime copies, nothing counted in memory")
    _retie_options(found)
    found.add_argument("--timeout", type=positive, metavar="S",
                        help="wall-clock seconds the whole command may take, onnxruntime's steps included; past them "
                             f"it stops with one line and writes nothing (default {isolated.TIMEOUT:g}, and "
                             f"{isolated.PER_GIB:g} more per GiB of the model's folder past the first)")
    found.add_argument("--memory-limit", type=_memory_limit, metavar="GiB",
                        help="address space each onnxruntime step may take (default 4 GiB + 6x the model's bytes)")
    found.add_argument("--proof-past", type=_past, metavar="N",
                        help="past tokens (KV cache length) in the decoder feeds the model is run and proven on "
                             f"(default {feeds.PAST}, or the longest sliding window the model or the "
                             "genai_config.json / config.json beside it declares)")
    found.add_argument("--prompt-length", type=_tokens, metavar="N",
                        help="prompt tokens at which a decoder's head scoring every position is costed (bytes of "
                             f"logits a prefill makes, and the head's share of its multiply-adds; default {PROMPT}, "
                             "or the context the model declares if shorter)")
    found.add_argument("--time-prefill", action="store_true",
                        help="measure the head's share of a prefill instead of counting it: one run at "
                             "--prompt-length tokens in an isolated child, under onnxruntime's defaults with its "
                             "profiler on (not made past 1 TFLOP or 120 s)")
    return found


def _retie_options(found):
    """--retie and the rewrites it is asked for (the parser's options that need it)."""
    found.add_argument("--retie", metavar="OUT.onnx", help="write a copy whose duplicated heads share their table, with the sidecar files its runtime reads")
    found.add_argument("--logits-to-keep", type=int, choices=(0, 1), metavar="K",
                        help="with --retie: add an int64 input num_logits_to_keep (default K, 0 or 1) whose value k "
                             "keeps the last k prompt positions before a decoder's head (0: all); K=1 for clients that "
                             "only generate, K=0 for clients that read every position")
    found.add_argument("--lookup-from-head", action="store_true",
                        help="with --retie: where a MatMulNBits head holds a float lookup table's values as 4- or "
                             "8-bit block codes, the lookup reads those codes (GatherBlockQuantized) and the float "
                             "table goes; opt-in: each looked-up row becomes the head's dequantization of it, proven "
                             "bit for bit, and what that costs the model is measured on a text (--text) and said")
    found.add_argument("--shared-int8", action="store_true",
                        help="with --retie: where a MatMulNBits head holds a float lookup table's values as block "
                             "codes, one int8 table made anew from the float one (blocks of 32, symmetric, scales of "
                             "the head's type, no zero points) is read by the head (bits=8) and by the lookup; the "
                             "float table and the head's old codes go; opt-in: the values change, proven rows, "
                             "measured price (excludes --lookup-from-head)")
    found.add_argument("--text", metavar="FILE",
                        help="with a --retie that changes values (--lookup-from-head): the UTF-8 text its price is "
                             "measured on, teacher-forced (KL divergence, same top token, perplexity; at least "
                             f"{SCORED} tokens where the text has them); default: the project's own text")
    found.add_argument("--reference", metavar="MODEL|FOLDER",
                        help="with a --retie that changes values: the float model the original and OUT are both "
                             "measured against (default: a transformers.js folder's fp32 variant, where there is one)")
