"""A folder's text report and --json document, from examine_folder.inspect_folder's findings: its verdict, a line
per file (each file's report under --verbose), then each table across the files."""
import os

from runtime.inspect import answer
from runtime.model.findings.counting import human, times
from runtime.inspect.report.file import as_json, held_line, report


def _stored_in(group):
    """The files that store a table (across the files' vocabulary entry), each once, in order."""
    return list(dict.fromkeys(s["file"] for s in group["stored"]))


def verdict_lines(result, verdict):
    """The lines a folder's report opens with (answer.lines): `verdict` (folder_verdict's of `result`) in words,
    each table with its size and the files that store it."""
    groups = {v["table"]: v for v in result["across"]["vocabulary"]}
    return answer.lines(verdict, groups, {t: _stored_in(v) for t, v in groups.items()}, "the client's process",
                        result["onnxruntime"] is None, len(result["items"]))


def folder_report(result, out, verbose=False):
    """The text report of a folder (folder.inspect_folder): its verdict, a line per file (each file's report under
    `verbose`), then each table across the files."""
    for line in verdict_lines(result, result["verdict"]):
        out.write(answer.line(line) + "\n")
    out.write("\n")
    folder_body(result, out, verbose)
    out.write(answer.FOOTER + "\n")


def folder_body(result, out, verbose=False):
    """A folder's report after its verdict: a line per file (each file's report under `verbose`), then each table
    across the files."""
    w = lambda text: out.write(answer.line(text) + "\n")
    across = result["across"]
    files = [it["file"] for it in result["items"]]
    w(f"{result['folder']}: {len(files)} file(s) a client loads together ({result['rule']})")
    for it in result["items"]:
        info = it["info"]
        if verbose:
            w("")
            w(f"== {it['file']}")
            report(info, os.path.join(result["folder"], it["file"]), out, verbose=True, in_folder=True)
            continue
        tables = ", ".join(t.initializer for t in info.tables) or "none"
        heads = ", ".join(dict.fromkeys(h.initializer for h in info.heads if h.scores)) or "none"
        w(f"  {it['file']}: {human(info.file_bytes)}; tables {tables}; heads {heads}")
    w("")
    w("across the files:")
    for v in across["vocabulary"]:
        if v["kind"] == "position" and v["copies_on_disk"] == 1:
            continue  # held once, in one file (--json lists it)
        kind = "position table" if v["kind"] == "position" else "table"
        stored = (f"stored {times(v['copies_on_disk'])} in {len(_stored_in(v))} file(s), {human(v['wasted_bytes'])} "
                  "wasted on disk" if v["copies_on_disk"] > 1 or len(files) > 1 else "stored once")
        w(f"{kind} {v['table']} ({v['file']}) {v['vocab_size']} x {v['width']} {v['format']}, {human(v['bytes'])}: "
          f"{stored}")
        if verbose:
            for s in v["stored"]:
                w(f"  stored: {s['file']} {s['name']}, {human(s['bytes'])}")
            roles = ", ".join(f"{r['file']} {r['node']} ({r['role']}{'' if r['graph'] == 'main' else ' in ' + r['graph']})"
                              for r in v["readers"])
            w(f"  read by: {roles}")
        w(f"  in one process holding every session: "
          f"{held_line(v['in_memory'], result['measure_error'], verbose, 'resident (Pss) after a run of each:')}")
        if v["config_tie"] is not None:
            w(f"  config: tie_word_embeddings {str(v['config_tie']).lower()}; the graph "
              f"{'scores with this table' if v['tied'] else _untied(v)}"
              f"{'' if v['tie_finding'] else ': as the config says'}")
    if verbose:
        for line in _same_across(across["pairs"]):
            w(line)
    if not across["pairs"] and len(files) > 1:  # of one file, nothing else could hold it
        w("no table held in more than one file")


_WIDTH = 99  # the most characters a line of the report's own grouping takes


def _same_across(pairs):
    """One line per tensor other files hold copies of (relate_files pairs each copy with the first it found, as
    `a`): a pair where there is one copy, else how many files hold it, a few of them named."""
    side = lambda x: f"{x['file']} {x['name']}" + ("" if x["graph"] == "main" else f" (in {x['graph']})")
    copies = {}
    for p in pairs:
        copies.setdefault(tuple(p["a"].values()), (p["a"], []))[1].append(p)
    for a, found in copies.values():
        if len(found) == 1:
            p = found[0]
            yield f"pair {side(a)} / {side(p['b'])}: {p['relation']}, {human(p['wasted_bytes'])} wasted on disk"
            continue
        files = list(dict.fromkeys([a["file"]] + [p["b"]["file"] for p in found]))
        kinds = {}
        for p in found:
            kinds[p["relation"]] = kinds.get(p["relation"], 0) + 1
        yield f"{len(files)} files hold the same table as {side(a)}"
        line = (f"  {', '.join(f'{n} {k}' for k, n in kinds.items())}; {human(sum(p['wasted_bytes'] for p in found))} "
                f"wasted on disk; in")
        for i, name in enumerate(files[1:]):  # as many as fit the line, the rest counted (--json names each)
            more = f" and {len(files) - 1 - i} more"
            if i and len(line) + len(name) + 2 + len(more) > _WIDTH:
                line += more
                break
            line += f"{',' if i else ''} {name}"
        yield line


def folder_json(result):
    """What --json prints of a folder."""
    vocabulary = [{k: v for k, v in group.items() if k != "members"}
                  for group in result["across"]["vocabulary"]]
    return {"model": result["folder"], "verdict": result["verdict"], "onnxruntime": result["onnxruntime"],
            "rule": result["rule"],
            "files": [{"path": it["file"], **as_json(it["info"], verdict=False)} for it in result["items"]],
            "across_files": {"pairs": result["across"]["pairs"], "vocabulary": vocabulary}}


def _untied(v):
    """What the graph does with an untied token table's values: a head holds them quantized, or no head reads them."""
    heads = v.get("quantized_heads")
    return f"holds them quantized in head {', '.join(heads)} (a tie up to rounding)" if heads else \
        "has no head reading these values"
