"""embed.py against hand-worked tables and independent recomputations (stdlib random, fixed seeds)."""
import math
import random
import struct
import subprocess
import sys

import pytest

import embed
from tests.helpers import ROOT

M64 = (1 << 64) - 1

# A hand-worked 4 x 2 table: row 3 is row 0 stretched twice; row 2 points the other way.
HAND = [[1.0, 0.0], [0.6, 0.8], [-1.0, 0.0], [2.0, 0.0]]


def is_float32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0] == x


def random_table(rng, vocab, width):
    """Small integers: every sum is exact, so rankings compare without rounding questions."""
    return [[float(rng.randint(-9, 9) or 1) for _ in range(width)] for _ in range(vocab)]


# --- make_table --------------------------------------------------------------------------------------

def test_make_table_known_splitmix64_value():
    # splitmix64 seeded with 0 first returns 0xE220A8397B1DCDAF (its published reference output); our
    # counter for (row 0, col 1) under seed 0 is exactly that state, so the value follows by hand.
    expected = ((0xE220A8397B1DCDAF >> 41) * 2 - (2**23 - 1)) / 2**23
    assert embed.make_table(1, 2, seed=0)[0][1] == expected


@pytest.mark.parametrize("vocab, width, seed", [(5, 1, 0), (3, 768, 7), (2, 33, -2**63), (4, 5, 2**64 + 3)])
def test_make_table_packed_rows_equal_mix64_value_by_value(vocab, width, seed):
    # make_table mixes a row's counters in 128-bit lanes of one int; the definition is one mix64 per value.
    key, table = embed.mix64(seed & (2**64 - 1)), embed.make_table(vocab, width, seed)
    for row in range(vocab):
        for col in range(width):
            z = embed.mix64((key + ((row << 32) | col) * embed.GOLDEN) & (2**64 - 1))
            assert table[row][col] == ((z >> 41) * 2 - (2**23 - 1)) / 2**23


@pytest.mark.slow
def test_make_table_far_rows_equal_mix64():
    row = 2**20 + 17  # a row of a large vocabulary: the counter's row part is well past 32 bits of golden
    table = embed.make_table(row + 1, 3, 1)
    key = embed.mix64(1)
    for col in range(3):
        z = embed.mix64((key + ((row << 32) | col) * embed.GOLDEN) & (2**64 - 1))
        assert table[row][col] == ((z >> 41) * 2 - (2**23 - 1)) / 2**23


def test_make_table_shape_values_and_determinism():
    table = embed.make_table(33, 7, seed=5)
    assert embed.shape(table) == (33, 7)
    values = [v for row in table for v in row]
    assert all(is_float32(v) and v != 0.0 and -1.0 < v < 1.0 for v in values)
    assert table == embed.make_table(33, 7, seed=5)
    assert len(set(values)) > 0.99 * len(values)  # no visible pattern of repeats


def test_make_table_rows_do_not_depend_on_vocab_size_and_seed_matters():
    small, doubled = embed.make_table(10, 4), embed.make_table(20, 4)
    assert doubled[:10] == small
    assert embed.make_table(10, 4, seed=1) != small
    assert embed.make_table(10, 4, seed=-1) != embed.make_table(10, 4, seed=1)


def test_make_table_same_in_another_process():
    code = "import sys; sys.path.insert(0, '.'); import embed; print(embed.make_table(3, 3, 9))"
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == str(embed.make_table(3, 3, 9))


@pytest.mark.parametrize("args, error", [((0, 4), ValueError), ((4, -1), ValueError), ((4.0, 4), TypeError),
                                         ((True, 4), TypeError), ((4, 4, "1"), TypeError)])
def test_make_table_bad_sizes(args, error):
    with pytest.raises(error):
        embed.make_table(*args)


# --- shape, counts, lookups ----------------------------------------------------------------------------

def test_shape_and_param_count():
    assert embed.shape(HAND) == (4, 2)
    assert (embed.param_count(4, 2), embed.param_count(4, 2, tied=False)) == (8, 16)
    assert embed.param_count(8, 2) == 2 * embed.param_count(4, 2)  # doubling the vocabulary doubles the table
    assert embed.param_count(50257, 768, tied=False) - embed.param_count(50257, 768) == 50257 * 768


@pytest.mark.parametrize("table", [[], [[]], [[1.0, 2.0], [3.0]]])
def test_shape_rejects_empty_and_ragged(table):
    with pytest.raises(ValueError):
        embed.shape(table)


def test_lookup_and_onehot_lookup_hand_worked():
    assert embed.one_hot(2, 4) == [0.0, 0.0, 1.0, 0.0]
    assert embed.lookup(HAND, [1, 1, 3]) == [[0.6, 0.8], [0.6, 0.8], [2.0, 0.0]]
    assert embed.onehot_lookup(HAND, [1, 1, 3]) == [[0.6, 0.8], [0.6, 0.8], [2.0, 0.0]]
    assert embed.lookup(HAND, []) == []


def test_lookup_returns_copies_and_leaves_input_alone():
    table = [[1.0, 2.0], [3.0, 4.0]]
    rows = embed.lookup(table, [0])
    rows[0][0] = 99.0
    assert table == [[1.0, 2.0], [3.0, 4.0]]


def test_onehot_lookup_equals_lookup_bit_for_bit_and_counts_products():
    table = embed.make_table(40, 6, seed=3)
    ids = [39, 0, 7, 7]
    rows, multiplications = embed.onehot_lookup_counted(table, ids)
    assert [[struct.pack("<d", v) for v in r] for r in rows] == \
           [[struct.pack("<d", v) for v in table[i]] for i in ids]
    assert multiplications == len(ids) * 40 * 6


@pytest.mark.parametrize("ids, error", [([4], IndexError), ([-1], IndexError), ([1.0], TypeError),
                                        ([True], TypeError), (2, TypeError)])
def test_lookup_bad_ids(ids, error):
    for fn in (embed.lookup, embed.onehot_lookup):
        with pytest.raises(error):
            fn(HAND, ids)


def test_one_hot_bad_arguments():
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        embed.one_hot(4, 4)
    with pytest.raises(ValueError):
        embed.one_hot(0, 0)


# --- scores --------------------------------------------------------------------------------------------

def test_dot_norm_cosine_hand_worked():
    assert embed.dot([1.0, 2.0, 3.0], [4.0, -5.0, 6.0]) == 12.0
    assert embed.norm([3.0, 4.0]) == 5.0
    assert embed.cosine([1.0, 0.0], [0.6, 0.8]) == pytest.approx(0.6, abs=1e-15)
    with pytest.raises(ValueError):
        embed.cosine([0.0, 0.0], [1.0, 0.0])
    with pytest.raises(ValueError):
        embed.dot([1.0], [1.0, 2.0])


def test_logits_hand_worked_and_own_row_wins():
    assert embed.logits(HAND, [1.0, 0.0]) == [1.0, 0.6, -1.0, 2.0]
    rng = random.Random(1)
    table = [[rng.uniform(-1, 1) for _ in range(16)] for _ in range(12)]
    for t in range(12):  # own score is |row|^2, the largest unless a longer row points the same way
        scores = embed.logits(table, table[t])
        assert scores[t] == pytest.approx(sum(v * v for v in table[t]), rel=1e-12)
    with pytest.raises(ValueError):
        embed.logits(HAND, [1.0, 0.0, 0.0])


def test_stretch_row_and_scale_sqrt_d():
    stretched = embed.stretch_row(HAND, 1, 0.5)
    assert stretched == [[1.0, 0.0], [0.3, 0.4], [-1.0, 0.0], [2.0, 0.0]]
    assert HAND[1] == [0.6, 0.8]
    table = [[3.0, 4.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    assert embed.scale_sqrt_d(table) == [[6.0, 8.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]  # sqrt(4) = 2


@pytest.mark.parametrize("factor, error", [(0, ValueError), (-2.0, ValueError), (float("inf"), ValueError),
                                           (float("nan"), ValueError), ("2", TypeError), (True, TypeError)])
def test_stretch_row_bad_factor(factor, error):
    with pytest.raises(error):
        embed.stretch_row(HAND, 0, factor)


def test_scale_sqrt_d_changes_length_never_direction():
    table = embed.make_table(20, 9, seed=2)
    scaled = embed.scale_sqrt_d(table)
    for row, big in zip(table, scaled):
        assert embed.norm(big) / embed.norm(row) == pytest.approx(3.0, rel=1e-15)  # sqrt(9)
        assert embed.cosine(row, big) == pytest.approx(1.0, abs=1e-15)


# --- neighbours ----------------------------------------------------------------------------------------

def test_neighbors_hand_worked_cosine_vs_dot():
    # From token 0: row 3 has the same direction (cosine 1) and twice the length; row 1 is 53 degrees off.
    assert embed.neighbors(HAND, 0, 3) == [3, 1, 2]
    assert embed.neighbors(HAND, 0, 3, "dot") == [3, 1, 2]
    assert embed.neighbors(HAND, 1, 3) == [0, 3, 2]  # cosine ties 0 and 3 (0.6 each): lower id first
    assert embed.neighbors(HAND, 1, 3, "dot") == [3, 0, 2]  # the long row wins by length


def test_neighbors_stretch_changes_dot_order_not_cosine():
    table = embed.stretch_row(HAND, 1, 10.0)  # row 1 now has length 10
    assert embed.neighbors(table, 0, 3) == embed.neighbors(HAND, 0, 3)
    assert embed.neighbors(table, 0, 1, "dot") == [1]


@pytest.mark.parametrize("seed", range(6))
def test_neighbors_property_against_brute_force(seed):
    rng = random.Random(seed)
    table = random_table(rng, rng.randint(2, 30), rng.randint(1, 6))
    vocab = len(table)
    q = rng.randrange(vocab)
    for metric in ("dot", "cosine"):
        score = {}
        for t in range(vocab):
            d = sum(a * b for a, b in zip(table[t], table[q]))
            nt = math.sqrt(sum(a * a for a in table[t]))
            nq = math.sqrt(sum(a * a for a in table[q]))
            score[t] = d if metric == "dot" else d / (nt * nq)
        expected = []
        remaining = [t for t in range(vocab) if t != q]
        while remaining:  # selection: highest score, lowest id among equals
            best = max(remaining, key=lambda t: (score[t], -t))
            expected.append(best)
            remaining.remove(best)
        got = embed.neighbors(table, q, vocab + 5, metric)  # k past the end gives all vocab - 1
        assert len(got) == vocab - 1
        if metric == "dot":  # integer sums: exact, so the order is exact too
            assert got == expected
        else:  # cosines from two formulas may differ in the last bit; compare as score sequences
            assert [round(score[t], 12) for t in got] == [round(score[t], 12) for t in expected]
        assert embed.neighbors(table, q, 0, metric) == []


@pytest.mark.parametrize("factor", [0.25, 4.0])  # powers of two: scaled cosines are bit-equal, ties included
def test_stretch_property_cosine_list_fixed(factor):
    rng = random.Random(7)
    table = random_table(rng, 25, 5)
    for t in range(0, 25, 5):
        stretched = embed.stretch_row(table, t, factor)
        for q in (1, 12):
            if q == t:
                continue
            assert embed.neighbors(stretched, q, 24) == embed.neighbors(table, q, 24)
            dots = embed.neighbors(stretched, q, 24, "dot")
            before = embed.neighbors(table, q, 24, "dot")
            climbs = (factor > 1) == (sum(a * b for a, b in zip(table[t], table[q])) > 0)
            moved = dots.index(t) - before.index(t)  # lengthening a row that agrees with q lifts it
            assert moved <= 0 if climbs else moved >= 0


@pytest.mark.parametrize("seed", range(4))
def test_scores_of_one_pass_ranks_as_neighbors_and_scores_as_logits(seed):
    rng = random.Random(seed)
    table = random_table(rng, rng.randint(3, 40), rng.randint(1, 6))
    table += [list(table[1]), [2.0 * v for v in table[2]]]  # a repeated row and a longer one: ties in both metrics
    queries = sorted(rng.sample(range(len(table)), 3))
    found = embed.scores_of(table, queries)
    assert list(found) == queries
    for q in queries:
        assert found[q]["dot"] == embed.logits(table, table[q])  # the same floats, bit for bit
        for metric in ("dot", "cosine"):
            for k in (0, 3, len(table) + 2):
                assert embed.ranked(found[q][metric], q, k) == embed.neighbors(table, q, k, metric)
    with pytest.raises(ValueError, match="row 1"):
        embed.scores_of([[1.0, 0.0], [0.0, 0.0]], [0])
    with pytest.raises(IndexError):
        embed.scores_of(HAND, [4])


def test_neighbors_errors():
    with pytest.raises(ValueError, match="metric"):
        embed.neighbors(HAND, 0, 1, "euclid")
    with pytest.raises(ValueError):
        embed.neighbors(HAND, 0, -1)
    with pytest.raises(TypeError):
        embed.neighbors(HAND, 0, 1.5)
    with pytest.raises(IndexError):
        embed.neighbors(HAND, 4, 1)
    with pytest.raises(ValueError, match="row 1"):
        embed.neighbors([[1.0, 0.0], [0.0, 0.0]], 0, 1)
    assert embed.neighbors([[1.0, 0.0], [0.0, 0.0]], 0, 1, "dot") == [1]  # dot needs no direction


def test_stretch_to_lead():
    table = [[1.0, 0.0], [0.9, 0.1], [0.3, 0.5], [-1.0, 1.0]]
    factor = embed.stretch_to_lead(table, 0, 2)  # dot 0.3 vs best other 0.9: x2 is not enough, x4 is
    assert factor == 4.0
    assert embed.neighbors(embed.stretch_row(table, 2, factor), 0, 1, "dot") == [2]
    assert embed.stretch_to_lead(table, 0, 3) is None  # it points away from the query


# --- the module as a program ---------------------------------------------------------------------------

def run_bare(*args):
    return subprocess.run(["python3", "-I", "-S", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_embed_runs_on_a_bare_python_without_numpy():
    code = "import sys; sys.path.insert(0, '.'); import embed; assert 'numpy' not in sys.modules; print('ok')"
    assert run_bare("-c", code).stdout == "ok\n"
    walk = run_bare("embed.py")
    assert walk.returncode == 0, walk.stderr
    assert "same values: True" in walk.stdout
    assert "unchanged: True" in walk.stdout and "leads: True" in walk.stdout
    assert f"(ratio {math.sqrt(8):.6f})" in walk.stdout


@pytest.mark.parametrize("args", [["--width", "0"], ["--ids", "1,x"], ["--query", "16"], ["--vocab-size", "q"],
                                  ["--k", "-1"], ["--nope"]])
def test_embed_cli_bad_arguments_one_line_exit_2(args):
    done = run_bare("embed.py", *args)
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.count("\n") == 1 and done.stderr.startswith("embed.py: error:")


def test_commands_end_quietly_when_the_reader_stops():
    """`| head`: the reader closes the pipe after one line; no traceback. compare flushes line by line, so its
    next line meets the closed pipe for sure: status 1, as Python's docs advise. The others may have written all
    they had into the pipe's buffer by then: 0 or 1."""
    for command, codes in (([sys.executable, "embed.py", "--vocab-size", "64"], (0, 1)),
                           ([sys.executable, "-m", "runtime.compare", "--vocab-size", "300", "--width", "24"], (1,)),
                           ([sys.executable, "-m", "runtime.inspect", "tests/fixtures/genai_fp32/model.onnx"], (0, 1))):
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        process.stdout.readline()
        process.stdout.close()  # what head does after its lines
        err = process.stderr.read().decode()
        assert process.wait(timeout=300) in codes and "Traceback" not in err and "Broken pipe" not in err, (command, err)
