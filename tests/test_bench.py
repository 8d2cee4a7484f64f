"""runtime.bench's pieces at toy sizes: they run and report consistent figures. No timing is asserted here."""
import json
import math

import numpy as np

from runtime import bench


def test_race_returns_a_time_for_every_contender():
    times = bench.race({"sum": lambda: sum(range(100)), "noop": lambda: None}, 0.01)
    assert set(times) == {"sum", "noop"} and all(0 < t < 1 for t in times.values())


def test_bound_run_writes_into_the_callers_buffer():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    import graphs
    ids = np.array([[2, 0]], dtype=np.int64)
    out = np.zeros((1, 2, 3), np.float32)
    bench.bound_run(bench.session(graphs.gather_lookup(table)), {"ids": ids}, {"embeddings": out})()
    assert np.array_equal(out, table[ids])


def test_bench_pieces_run_and_report(tmp_path):
    results = {}
    results["lookups"] = bench.bench_lookups([64], 8, 0.005)
    results["head"] = bench.bench_head(64, [1, 4], 0.005)
    results["memory"] = bench.bench_memory([(256, 16)], str(tmp_path))
    results["floor"] = bench.bench_floor(0.005)
    row = results["lookups"][0]
    assert row["onehot_multiplications"] == 8 * 64 * bench.WIDTH
    assert math.isclose(row["gather_vs_take"], row["gather_s"] / row["take_s"])
    head = results["head"][1]
    assert math.isclose(head["flop_per_s"], 2 * 4 * 64 * bench.WIDTH / head["ort_s"])
    assert [(m["tied"], m["external"], m["arena"]) for m in results["memory"]] == [
        (True, False, False), (True, True, False), (False, False, False), (False, True, False), (True, True, True)]
    assert all(m["table_bytes"] == 256 * 16 * 4 for m in results["memory"])
    text = bench.report(results)
    assert "a/b. lookups" in text and "d. resident memory" in text and "e. per-run floor" in text
    json.dumps(results)  # everything --json writes is plain data
