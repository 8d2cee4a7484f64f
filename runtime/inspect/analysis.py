"""What one inspect run finds, before a line of it is rendered: the file or folder examined (examine,
examine_folder), each decoder's prefill finding, and the verdict, each computed once. cli renders an Analysis;
the report, --json, --check and --retie all read the same verdict."""
import os
from typing import NamedTuple

from runtime.inspect.examine import inspect_model
from runtime.inspect.examine_folder import inspect_folder, inspect_variants
from runtime.inspect.sandbox.timing import time_prefill
from runtime.inspect.verdict import file_verdict, folder_verdict
from runtime.model.findings.counting import measured_settings
from runtime.model.findings.prefill import all_positions
from runtime.model.read.layout import variants


class Analysis(NamedTuple):
    """One run's findings. `kind`: "file" (`found` is examine.inspect_model's Findings), "folder" (examine_folder.
    inspect_folder's result) or "variants" (inspect_variants' list of {"dtype", "result"}); each file's Findings holds
    its prefill finding and verdict, each folder's result its "verdict" (verdict.file_verdict, folder_verdict).
    `verdict`: the run's, a variant's entries each with its `dtype`."""
    kind: str
    found: object
    verdict: list


def analyse(args, scratch, limits):
    """The Analysis of args.model (inspect's parsed arguments): `scratch` for onnxruntime's files, `limits` for its
    isolated children."""
    settings = measured_settings(args.verbose)
    if not os.path.isdir(args.model):
        info = inspect_model(args.model, scratch, limits, args.proof_past, args.static, settings)
        _prefill(info, args, scratch, limits)
        info.verdict = file_verdict(info, args.model)
        return Analysis("file", info, info.verdict)
    if args.dtype is None and not args.files and variants(args.model):
        found = inspect_variants(args.model, scratch, limits, args.proof_past, args.static, settings)
        for f in found:
            _judged(f["result"], args, scratch, limits)
        return Analysis("variants", found, [{**e, "dtype": f["dtype"]} for f in found for e in f["result"]["verdict"]])
    result = inspect_folder(args.model, scratch, limits, args.proof_past, args.dtype or args.files, args.static,
                            settings)
    _judged(result, args, scratch, limits)
    return Analysis("folder", result, result["verdict"])


def _judged(result, args, scratch, limits):
    """A folder's result with each file's prefill finding and, then, its verdict."""
    for it in result["items"]:
        _prefill(it["info"], args, scratch, limits)
    result["verdict"] = folder_verdict(result)


def _prefill(info, args, folder, limits):
    """info.prefill: a decoder's head scoring every prompt position, its share counted; measured on request."""
    info.prefill = all_positions(info, info.model, args.prompt_length)
    if args.time_prefill:
        time_prefill(info.model, info, folder, limits)
