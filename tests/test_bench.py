"""runtime.bench's pieces at toy sizes: they run and report consistent figures. No timing is asserted here."""
import json
import math

import numpy as np

import embed
import graphs
from runtime import bench


def test_race_returns_a_time_for_every_contender():
    times = bench.race({"sum": lambda: sum(range(100)), "noop": lambda: None}, 0.01)
    assert set(times) == {"sum", "noop"} and all(0 < t < 1 for t in times.values())


def test_bound_run_writes_into_the_callers_buffer():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.array([[2, 0]], dtype=np.int64)
    out = np.zeros((1, 2, 3), np.float32)
    bench.bound_run(bench.session(graphs.gather_lookup(table)), {"ids": ids}, {"embeddings": out})()
    assert np.array_equal(out, table[ids])


def test_bench_pieces_run_and_report(tmp_path):
    results = {}
    results["lookups"] = bench.bench_lookups([64], 8, 0.005)
    results["format_lookups"] = bench.bench_format_lookups([64, 256], 8, 0.005)
    results["head"] = bench.bench_head([(64, 32)], [1, 4], 0.005, str(tmp_path))
    results["memory"] = bench.bench_memory([(256, 16)], str(tmp_path))
    results["format_memory"] = bench.bench_format_memory([(256, 32)], str(tmp_path))
    results["floor"] = bench.bench_floor(0.005)
    row = results["lookups"][0]
    assert row["onehot_multiplications"] == 8 * 64 * bench.WIDTH
    assert math.isclose(row["gather_vs_take"], row["gather_s"] / row["take_s"])
    assert [r["format"] for r in results["format_lookups"]] == list(embed.FORMATS)
    head = results["head"][1]
    assert math.isclose(head["flop_per_s"], 2 * 4 * 64 * 32 / head["run_s"])
    assert math.isclose(head["run_vs_numpy"], head["run_s"] / head["numpy_s"])
    assert head["memory"]["table_bytes"] == 64 * 32 * 4 and head["memory"]["logits_bytes"] == 4 * 64 * 4
    assert [(m["tied"], m["external"], m["arena"]) for m in results["memory"]] == [
        (True, False, False), (True, True, False), (False, False, False), (False, True, False), (True, True, True)]
    assert all(m["table_bytes"] == 256 * 16 * 4 for m in results["memory"])
    assert [m["table_bytes"] for m in results["format_memory"]] == [
        embed.table_bytes(256, 32, fmt, 32 if fmt in ("int8", "int4") else None) for fmt in embed.FORMATS]
    text = bench.report(results)
    for section in ("a/b. lookups", "b'. the lookup at every format", "c. the tied head", "d. resident memory",
                    "d'. the tied head at every format", "e. per-run floor", "Runner.run(feeds) <= 1.0x"):
        assert section in text
    json.dumps(results)  # everything --json writes is plain data
