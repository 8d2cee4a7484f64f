"""What the files alone show of one checked model: its tables and heads, how they relate, and one vocabulary entry
per table, nothing counted in memory. inspect --static reports it; compare --model reads its token table from it."""
from runtime.model.findings import counting
from runtime.model.findings.relations import relate
from runtime.model.findings.vocabulary import vocabulary
from runtime.model.graph.walk import find_tables_and_heads


def _not_counted(names, table_bytes, other_bytes):
    return counting.not_counted()


def static_findings(model):
    """{tables, heads, pairs, vocabulary} of a checked Model (read.model.load), from its files alone."""
    tables, heads = find_tables_and_heads(model)
    pairs = relate(model, tables, heads)
    return {"tables": tables, "heads": heads, "pairs": pairs,
            "vocabulary": vocabulary(model, tables, heads, pairs, [], _not_counted, None)}
