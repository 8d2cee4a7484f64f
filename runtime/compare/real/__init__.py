"""python -m runtime.compare --model PATH: the lab's checks and the seed's claims on a real model's token table.

source: the table read (runtime.model's checked reader and table finder; gguf_table for a GGUF file) and decoded to
float32 as the model's lookup reads it; tokens: its token strings and queries; rows: the table as the pure-Python
reference reads it, a row at a time; pool: the reference's passes in two worker processes; lab: the lab's graphs on
it, saved once with one shared data file; checks: the lab's claims, PASS or FAIL against embed.py; figures: what the
table itself shows (INFO, never a verdict); report: the text a person reads and --json's table; plot: --plot; cli:
the run.
"""
