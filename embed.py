"""The reference: an embedding table, lookups into it, and scores out of it, in the standard library only.

A token id picks one row of a `vocab_size x width` table. Multiplying a one-hot vector by the
table gives the same row with every product done; a tied output head scores a hidden vector
against every row of that same table. Every graph in this project is checked against these
functions, so they favour being obviously right: dot products use math.fsum, which is exact for
float32 inputs (each product of two float32 values is exact in a float64), rounded once.

This module is the reference's public face; the functions live in `reference/`, by job: `tables` (the table
and its size), `scores` (lookups, scores, neighbours, stretching), `precision` (formats and bytes),
`walkthrough` (the command below and the command-line pieces the lab shares).

Runs on a bare `python3 -I -S`. `python3 embed.py --help` shows the walkthrough.
"""
import os
import sys

if __name__ == "__main__":  # `python3 -I -S embed.py` puts no folder on sys.path: make reference/ importable
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reference.precision import FORMATS, QMAX, dequantize, quantize, table_bytes  # noqa: E402
from reference.scores import (check_factor, check_id, check_ids, cosine, dot, lead_factor, logits, lookup,  # noqa: E402
                              neighbors, norm, one_hot, onehot_lookup, onehot_lookup_counted, ranked, scale_sqrt_d,
                              scores_of, stretch_row, stretch_to_lead)
from reference.tables import GOLDEN, check_int, make_table, mix64, param_count, shape  # noqa: E402
from reference.walkthrough import (ENDING, OneLineParser, Terminated, UsageError, check_fits, main,  # noqa: E402
                                   parse_ids, physical_memory, raise_on_sigterm, run_cli)

__all__ = ["FORMATS", "QMAX", "dequantize", "quantize", "table_bytes", "check_factor", "check_id", "check_ids",
           "cosine", "dot", "logits", "lookup", "neighbors", "norm", "one_hot", "onehot_lookup",
           "onehot_lookup_counted", "ranked", "scale_sqrt_d", "scores_of", "stretch_row", "stretch_to_lead",
           "lead_factor", "GOLDEN", "check_int", "make_table", "mix64", "param_count", "shape", "OneLineParser",
           "UsageError", "check_fits", "main", "parse_ids", "physical_memory", "raise_on_sigterm", "run_cli",
           "Terminated", "ENDING"]

if __name__ == "__main__":
    run_cli(main, prog="embed.py")
