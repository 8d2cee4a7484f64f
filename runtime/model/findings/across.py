"""A model is a folder: the files a client loads together, each inspected as a file, then related across files
(the same table stored in several of them, who reads it, what one process holding every session keeps) and
checked against config.json's tie_word_embeddings."""
import dataclasses
import json
import os
from typing import NamedTuple

from runtime.model.findings import counting
from runtime.model.findings.relations import Digests, Values, quantized_relation, table_shaped
from runtime.model.findings.vocabulary import copy_key
from runtime.model.read import sidecars
from runtime.model.read.model import label
from runtime.resident import copies_held, originals_held

_TIES = ("shared", "duplicate", "transposed_duplicate")


class Member(NamedTuple):
    """One table or head of a vocabulary group (`members` of relate_files' vocabulary entries): `item` the file's
    {"file", "model", "info"}, `entry` the walker's TableEntry or HeadEntry, `role` "lookup" or "head"."""
    item: dict
    entry: dict
    role: str

    @property
    def pair(self):
        """(item, entry)."""
        return self.item, self.entry


def config_tie(folder):
    """(tie_word_embeddings as config.json says it, or its text_config; transformers' default True when the key is
    absent) or None without a config."""
    try:
        config = json.loads(sidecars.read(os.path.join(folder, "config.json"), "config.json") or b"null")
    except (ValueError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    for section in (config, config.get("text_config")):
        if isinstance(section, dict) and isinstance(section.get("tie_word_embeddings"), bool):
            return section["tie_word_embeddings"]
    return True


def _side(member):
    item, entry = member.pair
    return {"file": item["file"], "name": entry.initializer, "graph": entry.graph}


def _quantized_across(a_item, a, b_item, b):
    """(relation, wasted bytes) of entries `a` and `b` from two files, one of them quantized, or None when neither
    holds the other's values."""
    both = _TwoFiles(a_item["model"], b_item["model"])
    relation, wasted, _ = quantized_relation(both, both.entry(0, a), both.entry(1, b),
                                             a.rows_are_tokens != b.rows_are_tokens)
    return None if relation == "distinct" else (relation, wasted)


def _same_across(a_item, a, b_item, b):
    """(relation, wasted bytes) of entries `a` and `b` from two files known to hold the same values: `shared` where
    both name the same bytes of one data file as the same layout (onnxruntime-genai's shared initializers)."""
    ta, tb = a_item["model"].tensors[a.initializer], b_item["model"].tensors[b.initializer]
    transposed = a.rows_are_tokens != b.rows_are_tokens
    if ta.external is not None and ta.external == tb.external and not transposed and ta.dims == tb.dims:
        return "shared", 0
    return ("transposed_duplicate" if transposed else "duplicate"), b.bytes


class _TwoFiles:
    """Two files' models seen as one (relations.quantized_relation reads `tensors`): each name behind the number of
    its side, so an entry of one file is compared with an entry of the other whatever names they share."""

    def __init__(self, a, b):
        self.sides = (a.tensors, b.tensors)
        self.tensors = self

    def __contains__(self, key):
        side, _, name = key.partition("\x1f") if isinstance(key, str) else ("", "", "")
        return side in ("0", "1") and name in self.sides[int(side)]

    def __getitem__(self, key):
        side, _, name = key.partition("\x1f")
        return self.sides[int(side)][name]

    def get(self, key, default=None):
        return self[key] if key in self else default

    @staticmethod
    def entry(side, entry):
        """The table or head `entry` of side 0 or 1, its tensors' names behind the side's number."""
        named = lambda n: None if n is None else f"{side}\x1f{n}"
        q = entry.quant
        return dataclasses.replace(entry, initializer=named(entry.initializer), scales=named(entry.scales),
                    quant=q and dataclasses.replace(q, codes=named(q.codes), scale=named(q.scale),
                                                    zero_point=named(q.zero_point)))


def relate_files(items):
    """{"pairs", "vocabulary"} across the files: `items` [{file, model, info}] (info: examine.inspect_model's).

    Equal values are grouped, not paired: each entry is related to the first entry of its values in another file
    (relations.Values: a fingerprint each, one comparison each), so n files holding one table give n - 1 pairs, all
    naming that first one as `a`. A quantized entry is compared with the first of each value of its shape."""
    entries = _entries(items)
    parent = list(range(len(entries)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(i, j):
        parent[root(j)] = root(i)
    first_of_name = {}
    for i, (it, e, _) in enumerate(entries):  # one tensor read as a table and as a head is one tensor
        key = (it["file"], e.initializer)
        if key in first_of_name:
            join(first_of_name[key], i)
        first_of_name.setdefault(key, i)
    for item in items:  # ties inside each file, as its own report found them
        for p in item["info"].pairs:
            if p.relation in _TIES:
                join(first_of_name[(item["file"], p.table)], first_of_name[(item["file"], p.head)])
    digests = {item["file"]: Digests(item["model"]) for item in items}
    values, firsts, quantized, pairs = Values(), {}, {}, []

    def related(i, j, found):
        pairs.append({"a": _side(entries[i]), "b": _side(entries[j]), "relation": found[0], "wasted_bytes": found[1]})
        join(i, j)
    for j, (item, entry, _) in enumerate(entries):
        shape = (entry.vocab, entry.width)
        if entry.quant:
            _relate_quantized(j, entries, quantized.setdefault(shape, []), firsts.get(shape, {}), related)
            continue
        number = values.of(item["model"], digests[item["file"]], entry)
        known = firsts.setdefault(shape, {})
        key = ("alone", j) if number is None else number
        if key not in known:
            known[key] = j
            for q in quantized.get(shape, []):  # a quantized entry seen before it
                if entries[q].item is not item and (found := _quantized_across(item, entry, *entries[q].pair)):
                    related(j, q, found)
                    break
        elif entries[known[key]].item is not item:
            related(known[key], j, _same_across(*entries[known[key]].pair, item, entry))
        else:  # the same values twice in one file: one table (its own report says how it is held)
            join(known[key], j)
    groups = {}
    for i in range(len(entries)):
        groups.setdefault(root(i), []).append(i)
    vocabulary = [_group(items, [entries[i] for i in members])
                  for members in groups.values() if any(entries[i].role == "lookup" for i in members)]
    return {"pairs": pairs, "vocabulary": vocabulary}


def _relate_quantized(j, entries, quantized, floats, related):
    """Relate quantized entry j to the first quantized entry of another file holding its values (a duplicate, or a
    second quantization of one table), else to the first float value of its shape it holds up to rounding; it is
    then the first of its values among `quantized` unless it duplicates one."""
    item, entry, _ = entries[j]
    for i in quantized:
        found = entries[i].item is not item and _quantized_across(*entries[i].pair, item, entry)
        if found:
            related(i, j, found)
            if found[0] not in _TIES:
                quantized.append(j)
            return
    quantized.append(j)
    for i in floats.values():  # at most one float value is this one up to rounding
        found = entries[i].item is not item and _quantized_across(*entries[i].pair, item, entry)
        if found:
            related(i, j, found)
            return


def _entries(items):
    """[Member]: every table of every file, and every head that can hold a table's values (of some
    file's table's vocab x width, or a table itself), each stored tensor once per file and orientation (its
    lookup's entry; a head's too where only the head says how it is quantized). A layer's weight is not read."""
    entries, seen = [], {}
    tables = [t for item in items for t in item["info"].tables]
    for item in items:
        own = {t.initializer for t in item["info"].tables}
        kept = {id(h) for h in table_shaped(tables, item["info"].heads)}
        heads = [h for h in item["info"].heads if id(h) in kept or h.initializer in own]  # in their order
        for role, found in (("lookup", item["info"].tables), ("head", heads)):
            for entry in found:
                key = (item["file"], entry.initializer, entry.rows_are_tokens)
                if key not in seen or (entry.quant and not entries[seen[key]].entry.quant):
                    seen[key] = len(entries)
                    entries.append(Member(item, entry, role))
    return entries


def _group(items, members):
    """The across-files vocabulary entry of one table and every copy of it: stored once per distinct bytes (a data
    file's range, or a file's own tensor: one file named twice, or linked, is one file)."""
    looked_up = next(m for m in members if m.role == "lookup")
    item, table = looked_up.item, looked_up.entry
    stored, identities = [], set()
    for m in members:
        tensor = m.item["model"].tensors[m.entry.initializer]
        identity = tensor.external or (os.path.realpath(m.item["model"].path), m.entry.initializer)
        if identity not in identities:
            identities.add(identity)
            stored.append({"file": m.item["file"], "name": m.entry.initializer, "bytes": m.entry.bytes})
    readers = []
    for it in items:
        names = {m.entry.initializer for m in members if m.item is it}
        for role, found in (("lookup", it["info"].tables), ("head", it["info"].heads)):
            readers += [{"file": it["file"], "node": label(e.node), "role": role, "graph": e.graph}
                        for e in found if e.initializer in names]
    kind = next((v["kind"] for v in item["info"].vocabulary if v["table"] == table.initializer), "token")
    return {"table": table.initializer, "file": item["file"], "graph": table.graph,
            "vocab_size": table.vocab, "width": table.width, "format": table.format,
            "bytes": table.bytes, "kind": kind, "copies_on_disk": len(stored),
            "wasted_bytes": sum(s["bytes"] for s in stored[1:]), "stored": stored, "readers": readers,
            "tied": any(r["role"] == "head" for r in readers), "members": members}


def held_together(group, items, measured, other_bytes):
    """The group's `in_memory`: per setting, the copies every file's session holds, counted by distinct stored bytes
    (a range of a data file that several files name is mapped, its pages held once, however many files name it)
    and the Pss the sessions together added (measure_together)."""
    entry = {}
    for setting, prepacking in counting.SETTINGS.items():
        copies, mapped = 0, set()
        for it in items:
            names = [m.entry.initializer for m in group["members"] if m.item is it]
            if not names:
                continue
            folded = [copy_key(c) for c in it["info"].runtime_copies
                      if c.get("copy_of") in names and c.get("view") != "prepacked"]
            optimized, prepacked = it["info"].optimized.proto, it["info"].prepacked
            copies += copies_held(names + folded, optimized, prepacked, prepacking)
            for name in originals_held(names, optimized, prepacked, prepacking):
                tensor = it["model"].tensors.get(name)
                if tensor is not None and tensor.external is not None:
                    if tensor.external in mapped:  # these bytes are held already, by another name
                        copies -= 1
                    mapped.add(tensor.external)
        entry[setting] = counting.held(copies, measured.get(setting), group["bytes"], other_bytes)
    return entry


def tie_finding(group, config, items):
    """None, "wrong_tie" (the config says untied, a head scores with the input table) or "lost_tie" (the config says
    tied, a head of the table's shape holds other values, not even the table's values quantized), for a token
    table's group."""
    if config is None or group["kind"] != "token":
        return None
    if config is False and group["tied"]:
        return "wrong_tie"
    if config is True and not group["tied"] and not quantized_heads(group, items):
        heads = [h for it in items for h in it["info"].heads
                 if (h.vocab, h.width) == (group["vocab_size"], group["width"])]
        return "lost_tie" if heads else None
    return None


def quantized_heads(group, items):
    """The heads that hold a token table group's values quantized (`quantized_copy` pairs of its members): a tie a
    quantizer kept up to rounding, not a lost one."""
    names = {(m.item["file"], m.entry.initializer) for m in group["members"]}
    return sorted({p.head for it in items for p in it["info"].pairs
                   if p.relation == "quantized_copy" and (it["file"], p.table) in names})


def disk_bytes(items):
    """The bytes on disk of a folder's client files (items [{model}]) and the data files they name, each data file
    once (two files may share one)."""
    files = {}
    for item in items:
        model = item["model"]
        files[os.path.realpath(model.path)] = model.checked["size"]
        files.update({path: identity[2] for path, identity in model.checked["files"].items()})
    return sum(files.values())
