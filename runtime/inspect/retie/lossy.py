"""What a retie that changes values (--lookup-from-head, --shared-int8) proves and measures beside the rest of the
proof: each lookup's rows as its head dequantizes them (the original then run on them), every id's row checked in
the isolated child, the greedy runs' agreement, and its price on a text (retie.quality); --json's records of it."""
import os

import numpy as np

from runtime.inspect.retie import headlookup, int8share, quality
from runtime.inspect.sandbox import isolated, jobs


def lookup_records(looked_up, file=None):
    """--json's `lookup_from_head` entries of a proven --lookup-from-head (Plan.looked_up): one a lookup rewritten,
    {"file", "table", "head", "rows_equal_head", "max_row_change", "max_row_change_in_steps", "token_agreement":
    {"prompts", "tokens", "agreed", "same_first", "prompts_from"}, "max_logit_change"} (the greedy figures are the
    file's)."""
    record, found = looked_up["record"], []
    greedy = {k: getattr(record.greedy, k) for k in ("prompts", "tokens", "agreed", "same_first", "prompts_from")}
    rows = {r.table: r.rows_equal_head for r in record.rows}
    for lookup in looked_up["lookups"]:
        found.append({"file": file, "table": lookup.table, "head": lookup.codes, "rows_equal_head": rows[lookup.table],
                      **looked_up["changes"][lookup.table], "token_agreement": greedy,
                      "max_logit_change": record.greedy.max_logit_change})
    return found


def head_rows_of(plan, folder):
    """{float table: jobs.head_rows}: each lookup's table as its head (as it is now) dequantizes it, written to
    `folder` as .npy (headlookup.head_rows), its change from the table kept in plan.looked_up["changes"]; a head
    --shared-int8 requantized goes with its new codes and scales (the original runs them too: jobs.requantized)."""
    tables = {p.table: p.table_entry for p in plan.found.pairs}
    replaced, changes = {}, {}
    for i, lookup in enumerate(plan.looked_up["lookups"]):
        head, table = lookup.head, tables[lookup.table]
        path = os.path.join(folder, f"head_rows_{i}.npy")
        changes[lookup.table] = headlookup.head_rows(plan.model, head, table, path)
        requantized = None
        if lookup.requantized:
            arrays = []
            for kind, name in (("codes", head.quant.codes), ("scales", head.quant.scale)):
                arrays.append(os.path.join(folder, f"head_{kind}_{i}.npy"))
                np.save(arrays[-1], plan.model.tensors[name].values())
            requantized = jobs.requantized(head.node.output[0], [head.quant.codes, head.quant.scale], arrays,
                                           {a.name: a.i for a in head.node.attribute
                                            if a.name in int8share.ATTRIBUTES})
        replaced[lookup.table] = jobs.head_rows(path, lookup.transposed, requantized)
    plan.looked_up["changes"] = changes
    return replaced


def lookup_proof(plan, staged, replaced, folder, limits):
    """Check every id's row of the staged retied model against the head's rows and measure greedy agreement with
    the original (sandbox.headrows, isolated); the record in plan.looked_up["record"]; failures (one line each)."""
    found, lookups = plan.found, plan.looked_up["lookups"]
    first = lookups[0].head
    vocab = first.vocab
    job = jobs.head_lookup(plan.model.checked, staged,
                           [jobs.lookup_check(k.output, k.table, replaced[k.table]["rows"]) for k in lookups],
                           jobs.greedy_feeds(found.rows, found.shape,
                                             headlookup.prompts_for(plan.model.path, vocab)),
                           first.scores or "logits", vocab, folder)
    limits.progress("checking every looked-up row and running both models greedily")
    record = isolated.call(job, "checking the lookup from the head", limits, plan.model.file_bytes)
    plan.looked_up["record"] = record
    return [f"{r.table}: the looked-up row of id {r.first_different} is not the head's dequantization of it"
            for r in record.rows if not r.rows_equal_head]


def replaced_kind(looked_up):
    """What a lossy retie replaced, for lines.rewritten_line: "int8" where --shared-int8 made the head's codes
    anew, True where the lookup reads the head's own, False where none."""
    if not looked_up:
        return False
    return "int8" if any(k.requantized for k in looked_up["lookups"]) else True


def priced(plan, staged, folder, limits, asked, file):
    """The quality record (retie.quality.measure) of a plan whose rewrite changes values (--lookup-from-head),
    proven and staged at `staged`, measured against its original; kept in asked.qualities with its `file`. None
    where the plan changes no value."""
    if not plan.looked_up:
        return None
    found = quality.measure(plan.model, plan.found, staged, folder, limits, asked.text, asked.reference)
    if asked.qualities is not None:
        asked.qualities.append({"file": file, **found})
    return found
