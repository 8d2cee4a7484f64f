"""runtime.bench's pieces at toy sizes: they run and report consistent figures. No timing is asserted here."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import embed
import graphs
from runtime import bench
from tests.helpers import ROOT


def test_race_returns_a_time_for_every_contender():
    times = bench.race({"sum": lambda: sum(range(100)), "noop": lambda: None}, 0.01)
    assert set(times) == {"sum", "noop"} and all(0 < t < 1 for t in times.values())


def test_bound_run_writes_into_the_callers_buffer():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.array([[2, 0]], dtype=np.int64)
    out = np.zeros((1, 2, 3), np.float32)
    bench.bound_run(bench.session(graphs.gather_lookup(table)), {"ids": ids}, {"embeddings": out})()
    assert np.array_equal(out, table[ids])


def test_packed_rows_lookup_gives_the_references_rows_bit_for_bit():
    table = graphs.make_table(40, 64, seed=3)
    stored = graphs.precision.store(table, "int4", 32)
    ids = np.array([[0, 39, 7, 7, 21]], np.int64)
    got = bench.session(bench.lookups.packed_rows_lookup(stored)).run(None, {"ids": ids})[0]
    codes, scales = embed.quantize(table.tolist(), "int4", 32)
    want = np.array([embed.dequantize(codes, scales, "int4", 32)[i] for i in ids[0]], np.float32)
    assert got.shape == (1, 5, 64) and got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    """Every section's figures at toy sizes, measured once for the tests below (each only reads them)."""
    folder = str(tmp_path_factory.mktemp("bench"))
    return {"lookups": bench.bench_lookups([64], 8, 0.005),
            "format_lookups": bench.bench_format_lookups([64, 256], 8, 0.005),
            "packed_rows": bench.lookups.bench_packed_rows(256, [1, 8], 0.005),
            "head": bench.bench_head([(64, 32)], [1, 4], 0.005, folder),
            "memory": bench.bench_memory([(256, 16)], folder),
            "formats": bench.bench_formats([(256, 64)], 0.005, folder),
            "floor": bench.bench_floor(0.005)}


@pytest.mark.slow
def test_bench_pieces_run_and_report(pieces):
    results = pieces
    row = results["lookups"][0]
    assert row["onehot_multiplications"] == 8 * 64 * bench.WIDTH  # n x V x D, counted independently here
    assert [r["format"] for r in results["format_lookups"]] == list(embed.FORMATS)
    assert all(r["spread"][0] <= r["large_vs_small"] <= r["spread"][1] for r in results["format_lookups"])
    head = results["head"][1]
    assert head["memory"]["table_bytes"] == 64 * 32 * 4 and head["memory"]["logits_bytes"] == 4 * 64 * 4
    assert [(m["tied"], m["external"], m["arena"]) for m in results["memory"]] == [
        (True, False, False), (True, True, False), (False, False, False), (False, True, False), (True, True, True)]
    assert all(m["table_bytes"] == 256 * 16 * 4 for m in results["memory"])
    assert [r["same_bits"] for r in results["packed_rows"]] == [True, True]
    assert [(m["format"], m["variant"], m["table_bytes"]) for m in results["formats"]] == [
        (fmt, None, embed.table_bytes(256, 64, fmt, 32 if fmt in ("int8", "int4") else None))
        for fmt in embed.FORMATS] + [("bfloat16", "constant folding off", embed.table_bytes(256, 64, "bfloat16"))]
    floor = [m["floor_s"] * m["bandwidth"] for m in results["formats"]]  # the floor is the bytes at that rate
    assert [round(f) for f in floor] == [m["table_bytes"] for m in results["formats"]]
    float32 = results["formats"][0]
    assert float32["top8_overlap"] == 1.0 and float32["logit_error"] < 1e-3  # the float32 head against numpy's
    json.dumps(results)  # everything --json writes is plain data


@pytest.mark.slow
@pytest.mark.parametrize("section", ["a/b. lookups", "b'. the lookup at every format", "b''. the int4 lookup two ways",
                                     "c. the tied head", "d. resident memory", "d'. the memory meeting",
                                     "e. per-run floor", "Runner.run(feeds) <= 1.0x"])
def test_the_report_has_every_section(pieces, section):
    assert section in bench.report(pieces)


def test_the_package_names_stay_functions_whoever_imports_a_submodule_first():
    # a fresh process: markdown imports the report's module before anyone asks the package for `report`
    script = ("import runtime.bench.markdown, runtime.bench.cli; from runtime import bench; "
              "print(callable(bench.report), callable(bench.targets), callable(bench.main))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (done.returncode, done.stdout) == (0, "True True True\n"), done.stderr


def known_figures(over=None):
    """A results dict whose figures meet every target, with `over` {(section, index, key): value} changed."""
    results = {
        "memory": [{"tied": True, "arena": False, "after_first_run": 1.05}, {"tied": False, "arena": False,
                                                                          "after_first_run": 2.05}],
        "lookups": [{"tokens": 256, "gather_vs_take": 0.2}],
        "head": [{"vocab": 64, "width": 32, "tokens": 1, "run_vs_numpy": 0.9, "run_out_vs_numpy": 0.9,
                  "memory": {"ratio": 1.05}}],
        "format_lookups": [{"format": fmt, "large_vs_small": 1.1} for fmt in embed.FORMATS],
        "formats": [{"format": fmt, "vocab": v, "width": w, "token_vs_float32": 0.1, "token_vs_floor": 1.5,
                     "times_table": 2.2} for fmt in embed.FORMATS for v, w in ((50257, 768), (128256, 4096))],
    }
    for (section, index, key), value in (over or {}).items():
        results[section][index][key] = value
    return results


def test_targets_judge_the_figures_they_are_given():
    assert all(met for _, met in bench.targets(known_figures()))
    over = {("memory", 0, "after_first_run"): 1.11, ("head", 0, "run_vs_numpy"): 1.2,
            ("format_lookups", 4, "large_vs_small"): 1.6, ("formats", 8, "token_vs_float32"): 0.5}
    missed = [what for what, met in bench.targets(known_figures(over)) if not met]
    assert len(missed) == 4 and missed[3].startswith("int4 head <= 0.20x") and "50257x768: 0.50x" in missed[3]
    assert missed[0].startswith("tied <= 1.10x table bytes")
    assert missed[1].startswith("Runner.run(feeds) <= 1.0x") and "N=1: 1.20x" in missed[1]
    assert missed[2].startswith("a lookup costs its rows") and "int4: 1.60x" in missed[2]


def bench_cli(*args):
    return subprocess.run([sys.executable, "-m", "runtime.bench", *map(str, args)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


@pytest.mark.parametrize("args", [["--json", "{tmp}"], ["--json", "{tmp}/missing/b.json"], ["--plot", "{tmp}"]],
                         ids=["json-folder", "json-no-folder", "plot-folder"])
def test_bad_output_paths_are_refused_before_measuring(tmp_path, args):
    done = bench_cli(*[a.format(tmp=tmp_path) for a in args])
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []


def _tables(text):
    """{region name: (rows of cells, the line after the table)} of every <!-- bench:NAME --> region in `text`,
    each table checked to parse: a header, a separator row of as many columns, rows of as many cells."""
    found = {}
    for name, body in re.findall(r"<!-- bench:([a-z_]+) -->\n(.*?)<!-- /bench -->", text, re.S):
        lines = body.rstrip("\n").split("\n")
        table = [line for line in lines if line.startswith("|")]
        cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
        assert len(cells) >= 3 and all(len(row) == len(cells[0]) for row in cells), name
        assert all(re.fullmatch(r":?-{3,}:?", c) for c in cells[1]), name
        found[name] = (cells[2:], lines[-1])
    return found


@pytest.mark.slow
def test_markdown_writes_every_table_with_the_run_it_comes_from(tmp_path, pieces):
    results = bench.cli.about(quick=True)
    results.update(seconds=12.0, command="python -m runtime.bench --quick")
    results.update(pieces)
    page = tmp_path / "tables.md"
    bench.cli.write_markdown(str(page), results)  # a new file: every table, each in its region
    tables = _tables(page.read_text())
    # every table but those measured only when asked (--scale), which this run was not
    assert list(tables) == [name for name in bench.markdown.TABLES if name not in bench.markdown.OPTIONAL]
    assert bench.markdown.OPTIONAL == {"scale"}
    stamp = f"*{results['date']}, {results['cpu']} ({os.cpu_count()} cores), onnxruntime {results['onnxruntime']}"
    assert all(after.startswith(stamp) and after.endswith("; `--quick`*") for _, after in tables.values())
    machine = dict((row[0], row[1]) for row in tables["machine"][0])
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", machine["date (UTC)"])
    assert machine["CPU"] == results["cpu"] and machine["cores"] == str(os.cpu_count())
    assert machine["duration"] == "0.2 minutes" and machine["onnxruntime"] == results["onnxruntime"]
    assert [row[1] for row in tables["formats"][0]] == list(embed.FORMATS) + ["bfloat16, constant folding off"]
    assert tables["lookups"][0][0][:2] == ["64", "8"] and len(tables["targets"][0]) == len(bench.targets(results))
    # a page of its own (BENCHMARKS.md): only the regions are rewritten, the prose around them kept
    own = tmp_path / "own.md"
    own.write_text("# Mine\n\nWords before.\n\n<!-- bench:floor -->\nstale\n<!-- /bench -->\n\nWords after.\n")
    bench.cli.write_markdown(str(own), results)
    text = own.read_text()
    assert text.startswith("# Mine\n\nWords before.\n\n<!-- bench:floor -->\n| ") and text.endswith(
        "<!-- /bench -->\n\nWords after.\n") and "stale" not in text and list(_tables(text)) == ["floor"]


@pytest.mark.parametrize("text, words", [("no regions here\n", "holds no <!-- bench:NAME -->"),
                                         ("<!-- bench:nonsense -->\n<!-- /bench -->\n", "no table named 'nonsense'")],
                         ids=["no-region", "unknown-region"])
def test_markdown_refuses_a_page_it_cannot_fill_before_measuring(tmp_path, text, words):
    (tmp_path / "page.md").write_text(text)
    done = bench_cli("--markdown", tmp_path / "page.md")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and words in done.stderr, done.stderr
    assert done.stderr.startswith("python -m runtime.bench: error: --markdown ")
    assert (tmp_path / "page.md").read_text() == text  # refused before measuring: the page as it was
