"""A model is a folder: the files a client loads together, each inspected as a file, then related across files
(the same table stored in several of them, who reads it, what one process holding every session keeps) and
checked against config.json's tie_word_embeddings."""
import dataclasses
import json
import os

from runtime.inspect.findings import counting
from runtime.inspect.findings.relations import Digests, copy_key, quantized_relation, same_values, stored_as_table
from runtime.inspect.read import sidecars
from runtime.inspect.read.model import label
from runtime.resident import copies_held

_TIES = ("shared", "duplicate", "transposed_duplicate")


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


def _side(item, entry):
    return {"file": item["file"], "name": entry["initializer"], "graph": entry.get("graph", "main")}


def _across(a_item, a, b_item, b, digests):
    """(relation, wasted bytes) of entries `a` and `b` from two files, or None when they are not the same values."""
    ta, tb = a_item["model"].tensors[a["initializer"]], b_item["model"].tensors[b["initializer"]]
    transposed = stored_as_table(a) != stored_as_table(b)
    if ta.external is not None and ta.external == tb.external and not transposed and ta.dims == tb.dims:
        return "shared", 0  # the same bytes of one data file (onnxruntime-genai's shared initializers)
    if a.get("quant") or b.get("quant"):
        both = _TwoFiles(a_item["model"], b_item["model"])
        relation, wasted, _ = quantized_relation(both, both.entry(0, a), both.entry(1, b), transposed)
        return None if relation == "distinct" else (relation, wasted)
    da, db = digests[a_item["file"]](a), digests[b_item["file"]](b)
    if da is not None and db is not None and da != db:
        return None
    if same_values(ta, tb, transposed=transposed):
        return ("transposed_duplicate" if transposed else "duplicate"), b["bytes"]
    return None


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
        q = entry.get("quant")
        return dict(entry, initializer=named(entry["initializer"]), scales=named(entry.get("scales")),
                    quant=q and dataclasses.replace(q, codes=named(q.codes), scale=named(q.scale),
                                                    zero_point=named(q.zero_point)))


def relate_files(items):
    """{"pairs", "vocabulary"} across the files: `items` [{file, model, info}] (info: examine.inspect_model's)."""
    digests = {item["file"]: Digests(item["model"]) for item in items}
    entries = []  # (item, entry, role): every table and head, each stored tensor once per file and orientation
    seen = set()
    for item in items:
        for role, found in (("lookup", item["info"]["tables"]), ("head", item["info"]["heads"])):
            for entry in found:
                key = (item["file"], entry["initializer"], stored_as_table(entry))
                if key not in seen:
                    seen.add(key)
                    entries.append((item, entry, role))
    parent = list(range(len(entries)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    index = {(it["file"], e["initializer"]): i for i, (it, e, _) in enumerate(entries)}
    for item in items:  # ties inside each file, as its own report found them
        for p in item["info"]["pairs"]:
            if p["relation"] in _TIES:
                parent[root(index[(item["file"], p["head"])])] = root(index[(item["file"], p["table"])])
    pairs = []
    for i, (a_item, a, _) in enumerate(entries):
        for j in range(i + 1, len(entries)):
            b_item, b, _ = entries[j]
            if a_item is b_item or (a["vocab"], a["width"]) != (b["vocab"], b["width"]):
                continue
            found = _across(a_item, a, b_item, b, digests)
            if found:
                pairs.append({"a": _side(a_item, a), "b": _side(b_item, b), "relation": found[0],
                              "wasted_bytes": found[1]})
                parent[root(j)] = root(i)
    groups = {}
    for i in range(len(entries)):
        groups.setdefault(root(i), []).append(i)
    vocabulary = [_group(items, [entries[i] for i in members], pairs)
                  for members in groups.values() if any(entries[i][2] == "lookup" for i in members)]
    return {"pairs": pairs, "vocabulary": vocabulary}


def _group(items, members, pairs):
    """The across-files vocabulary entry of one table and every copy of it."""
    item, table, _ = next(m for m in members if m[2] == "lookup")
    stored, identities = [], set()
    for it, entry, _ in members:
        tensor = it["model"].tensors[entry["initializer"]]
        identity = tensor.external or (it["file"], entry["initializer"])
        if identity not in identities:
            identities.add(identity)
            stored.append({"file": it["file"], "name": entry["initializer"], "bytes": entry["bytes"]})
    readers = []
    for it in items:
        names = {e["initializer"] for i, e, _ in members if i is it}
        for role, found in (("lookup", it["info"]["tables"]), ("head", it["info"]["heads"])):
            readers += [{"file": it["file"], "node": label(e["node"]), "role": role, "graph": e.get("graph", "main")}
                        for e in found if e["initializer"] in names]
    sides = {(it["file"], e["initializer"]) for it, e, _ in members}
    shared_links = sum(1 for p in pairs if p["relation"] == "shared" and (p["a"]["file"], p["a"]["name"]) in sides)
    kind = next((v["kind"] for v in item["info"]["vocabulary"] if v["table"] == table["initializer"]), "token")
    return {"table": table["initializer"], "file": item["file"], "graph": table.get("graph", "main"),
            "vocab_size": table["vocab"], "width": table["width"], "format": table["format"],
            "bytes": table["bytes"], "kind": kind, "copies_on_disk": len(stored),
            "wasted_bytes": sum(s["bytes"] for s in stored[1:]), "stored": stored, "readers": readers,
            "tied": any(r["role"] == "head" for r in readers), "members": members, "shared_links": shared_links}


def held_together(group, items, measured, other_bytes):
    """The group's `in_memory`: per setting, copies every file's session holds (summed; a data file's bytes that two
    files name count once) and the Pss the sessions together added (measure_together)."""
    entry = {}
    for setting, prepacking in counting.SETTINGS.items():
        copies = 0
        for it in items:
            names = [e["initializer"] for i, e, _ in group["members"] if i is it]
            if not names:
                continue
            folded = [copy_key(c) for c in it["info"]["runtime_copies"]
                      if c.get("copy_of") in names and c.get("view") != "prepacked"]
            copies += copies_held(names + folded, it["info"]["optimized"].proto, it["info"]["prepacked"], prepacking)
        copies -= group["shared_links"]  # one data file's bytes named by two files: mapped pages, held once
        entry[setting] = counting.held(copies, measured.get(setting), group["bytes"], other_bytes)
    return entry


def tie_finding(group, config, items):
    """None, "wrong_tie" (the config says untied, a head scores with the input table) or "lost_tie" (the config says
    tied, a head of the table's shape holds other values), for a token table's group."""
    if config is None or group["kind"] != "token":
        return None
    if config is False and group["tied"]:
        return "wrong_tie"
    if config is True and not group["tied"]:
        heads = [h for it in items for h in it["info"]["heads"]
                 if (h["vocab"], h["width"]) == (group["vocab_size"], group["width"])]
        return "lost_tie" if heads else None
    return None


def held_twice(info):
    """--check for a file: whether a table is stored twice in it (a duplicate head) or held more than once by a
    session under onnxruntime's defaults."""
    return any(p["relation"] in ("duplicate", "transposed_duplicate") for p in info["pairs"]) or any(
        (v["tables_in_memory"] or 0) > 1 for v in info["vocabulary"])


def folder_held_twice(result):
    """--check for a folder: held_twice in any file, a table stored in more than one place or held more than once
    by the client's sessions together, or a tie the config contradicts."""
    return any(held_twice(it["info"]) for it in result["items"]) or any(
        v["copies_on_disk"] > 1 or (v["in_memory"]["defaults"]["copies"] or 0) > 1 or v["tie_finding"]
        for v in result["across"]["vocabulary"])


def disk_bytes(items):
    """The bytes on disk of a folder's client files (items [{model}]) and the data files they name, each data file
    once (two files may share one)."""
    files = {}
    for item in items:
        model = item["model"]
        files[os.path.realpath(model.path)] = model.checked["size"]
        files.update({path: identity[2] for path, identity in model.checked["files"].items()})
    return sum(files.values())
