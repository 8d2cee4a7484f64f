"""Each graph run in onnxruntime, with expectations computed independently by numpy from the table."""
import math
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import embed
import graphs
from graphs.export import FILES
from tests.helpers import ROOT

U = 2.0**-24  # float32 unit roundoff
V, D = 97, 24
TABLE = graphs.make_table(V, D, seed=4)
HEAD = graphs.make_table(V, D, seed=5)
RNG = np.random.default_rng(11)
IDS = RNG.integers(0, V, size=(3, 5), dtype=np.int64)
IDS[0, :2] = [V - 1, V - 1]  # a repeated id, and the last row
HIDDEN = RNG.standard_normal((3, 5, D)).astype(np.float32)


def session(model, optimized_path=None):
    options = ort.SessionOptions()
    if optimized_path:
        options.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run(model, **feeds):
    return session(model).run(None, feeds)


def bits(array):
    return np.ascontiguousarray(array).view(np.uint32)


def gamma(n):
    return n * U / (1 - n * U)


def vocab_width_tensors(model):
    return [t for t in model.graph.initializer if list(t.dims) == [V, D]]


# --- make_table ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab, width, seed", [(1, 1, 0), (33, 7, 3), (130, 5, -8), (300, 2, 2**66 + 5)])
def test_make_table_bit_identical_to_reference(vocab, width, seed):
    expected = np.array(embed.make_table(vocab, width, seed), dtype=np.float64)  # python floats, exact
    got = graphs.make_table(vocab, width, seed)
    assert (got.shape, got.dtype) == ((vocab, width), np.float32)
    assert np.array_equal(got.astype(np.float64).view(np.uint64), expected.view(np.uint64))


def test_make_table_rows_independent_of_vocab():
    assert np.array_equal(bits(graphs.make_table(600, 3)[:257]), bits(graphs.make_table(257, 3)))


# --- the lookups --------------------------------------------------------------------------------------

def test_gather_lookup_rows():
    (out,) = run(graphs.gather_lookup(TABLE), ids=IDS)
    assert (out.shape, out.dtype) == ((3, 5, D), np.float32)
    assert np.array_equal(bits(out), bits(TABLE[IDS]))
    assert np.array_equal(bits(out[0, 0]), bits(out[0, 1]))  # same id, same vector, whatever surrounds it


def test_onehot_lookup_equals_gather_bit_for_bit():
    (hot,) = run(graphs.onehot_lookup(TABLE), ids=IDS)
    (rows,) = run(graphs.gather_lookup(TABLE), ids=IDS)
    assert (hot.shape, hot.dtype) == (rows.shape, rows.dtype)
    assert np.array_equal(bits(hot), bits(rows))
    assert np.array_equal(bits(hot), bits(TABLE[IDS]))


def test_gather_lookup_negative_id_wraps_out_of_range_fails():
    model = graphs.gather_lookup(TABLE)
    (wrapped,) = run(model, ids=np.array([[-1, -V]], dtype=np.int64))
    assert np.array_equal(bits(wrapped[0]), bits(TABLE[[V - 1, 0]]))  # silently another token
    with pytest.raises(Exception, match="out of data bounds"):
        run(model, ids=np.array([[V]], dtype=np.int64))


def test_onehot_lookup_negative_id_wraps_out_of_range_gives_zero_row():
    (out,) = run(graphs.onehot_lookup(TABLE), ids=np.array([[-1, V, V + 7]], dtype=np.int64))
    assert np.array_equal(bits(out[0, 0]), bits(TABLE[V - 1]))
    assert not out[0, 1:].any()  # no error at all: a zero vector the model would take as real


def test_scaled_lookup_is_sqrt_width_times_the_row():
    (out,) = run(graphs.scaled_lookup(TABLE), ids=IDS)
    exact = TABLE[IDS].astype(np.float64) * math.sqrt(D)
    # two float32 roundings (sqrt(D), then the product), each at most u relative
    assert np.all(np.abs(out - exact) <= 2 * U * np.abs(exact) * (1 + 2 * U))
    norms = np.linalg.norm(out.astype(np.float64), axis=-1) / np.linalg.norm(TABLE[IDS].astype(np.float64), axis=-1)
    # each value within 2u relative, so each norm too; plus float64's own rounding of the two norms
    assert np.all(np.abs(norms - math.sqrt(D)) <= (2 * U * (1 + 2 * U) + (D + 4) * 2.0**-53) * math.sqrt(D))


# --- the heads ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_logits_within_float32_bound(tied):
    model = graphs.tied_logits(TABLE) if tied else graphs.untied_logits(TABLE, HEAD)
    head = TABLE if tied else HEAD
    embeddings, logits = run(model, ids=IDS, hidden=HIDDEN)
    assert np.array_equal(bits(embeddings), bits(TABLE[IDS]))
    assert (logits.shape, logits.dtype) == ((3, 5, V), np.float32)
    products = HIDDEN.astype(np.float64)[..., None, :] * head.astype(np.float64)  # (3, 5, V, D), exact
    exact = products.sum(-1)
    bound = gamma(D) * np.abs(products).sum(-1)
    assert not np.isnan(logits).any()
    assert np.all(np.abs(logits - exact) <= bound)


def test_tied_logits_holds_one_table_untied_two():
    tied, untied = graphs.tied_logits(TABLE), graphs.untied_logits(TABLE, HEAD)
    assert [t.name for t in vocab_width_tensors(tied)] == ["embedding"]
    assert [t.name for t in vocab_width_tensors(untied)] == ["embedding", "lm_head"]
    node = {n.op_type: n for n in tied.graph.node}
    # the tie: the one table forks to the lookup and, through a view of its own shape, to the head
    assert [n.name for n in tied.graph.node if "embedding" in n.input] == ["lookup", "tie_view"]
    assert node["Gather"].input[0] == node["Reshape"].input[0] == "embedding"
    assert node["FusedMatMul"].input[1] == node["Reshape"].output[0]
    elements = lambda m: sum(math.prod(t.dims) for t in vocab_width_tensors(m))
    assert elements(tied) == embed.param_count(V, D)
    assert elements(untied) == embed.param_count(V, D, tied=False)
    assert [p.value for p in tied.metadata_props if p.key == "parameter_count"] == [str(V * D)]


def test_tied_logits_stays_one_table_after_onnxruntime_optimizes(tmp_path):
    optimized = tmp_path / "tied.opt.onnx"
    session(graphs.tied_logits(TABLE), optimized)
    assert len(vocab_width_tensors(onnx.load(optimized))) == 1
    tables = [t for t in onnx.load(optimized).graph.initializer if math.prod(t.dims) == V * D]
    assert [t.name for t in tables] == ["embedding"]


def test_matmul_transpose_head_would_be_folded_into_a_second_table(tmp_path):
    """Why the head is not MatMul: MatMul(hidden, Transpose(embedding)) gets a [width, vocab] copy at session start."""
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["embeddings"], axis=0),
             helper.make_node("Transpose", ["embedding"], ["embedding_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["hidden", "embedding_t"], ["logits"])]
    graph = helper.make_graph(
        nodes, "matmul_transpose_head",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("hidden", onnx.TensorProto.FLOAT, ["batch", "seq", D])],
        [helper.make_tensor_value_info("embeddings", onnx.TensorProto.FLOAT, None),
         helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(TABLE, "embedding")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    optimized = tmp_path / "matmul.opt.onnx"
    session(model, optimized)
    shapes = sorted(list(t.dims) for t in onnx.load(optimized).graph.initializer if math.prod(t.dims) == V * D)
    assert shapes == [[D, V], [V, D]]


def test_untied_logits_rejects_a_head_of_another_shape():
    with pytest.raises(ValueError, match=r"\(96, 24\)"):
        graphs.untied_logits(TABLE, HEAD[:-1])


# --- neighbours ---------------------------------------------------------------------------------------

def reference_scores(table, metric):
    t = table.astype(np.float64)
    dots = t @ t.T  # exact enough: float64 sums of exact products, D = 24 terms
    if metric == "dot":
        return dots, gamma(D) * np.abs(t) @ np.abs(t).T
    norms = np.linalg.norm(t, axis=1)
    cos = dots / np.outer(norms, norms)
    # the graph's float32 dot, norms, product and division: a few units of roundoff on top of the sum's
    return cos, (gamma(D) * (np.abs(t) @ np.abs(t).T) / np.outer(norms, norms)) + gamma(D + 4) * np.abs(cos)


@pytest.mark.parametrize("metric", ["cosine", "dot"])
@pytest.mark.parametrize("k", [1, 6, V - 1, V + 10])
def test_neighbors_against_numpy_ranking(metric, k):
    queries = np.array([0, 13, V - 1, 13], dtype=np.int64)
    indices, scores = run(graphs.neighbors(TABLE, metric), ids=queries, k=np.array([k], dtype=np.int64))
    kept = min(k, V - 1)
    assert (indices.shape, indices.dtype, scores.dtype) == ((4, kept), np.int64, np.float32)
    exact, tol = reference_scores(TABLE, metric)
    for row, q in enumerate(queries):
        order = sorted((t for t in range(V) if t != q), key=lambda t: (-exact[q, t], t))[:kept]
        assert q not in indices[row]
        assert np.all(np.abs(scores[row] - exact[q, indices[row]]) <= tol[q, indices[row]])
        for got, want in zip(indices[row], order):  # exact, except between scores the tolerance cannot split
            assert got == want or abs(exact[q, got] - exact[q, want]) <= tol[q, got] + tol[q, want]


def test_neighbors_ties_go_to_the_lower_id():
    table = np.array([[1, 0], [2, 0], [1, 0], [0, 1], [1, 0]], dtype=np.float32)  # 1, 2 and 4 tie on cosine
    indices, _ = run(graphs.neighbors(table, "cosine"), ids=np.array([0]), k=np.array([4]))
    assert indices.tolist() == [[1, 2, 4, 3]] == [embed.neighbors(table.tolist(), 0, 4)]
    indices, _ = run(graphs.neighbors(table, "dot"), ids=np.array([0]), k=np.array([4]))
    assert indices.tolist() == [[1, 2, 4, 3]]


def test_neighbors_rejects_unknown_metric():
    with pytest.raises(ValueError, match="metric"):
        graphs.neighbors(TABLE, "l2")


# --- what Netron shows --------------------------------------------------------------------------------

ALL = {"gather_lookup": lambda: graphs.gather_lookup(TABLE), "onehot_lookup": lambda: graphs.onehot_lookup(TABLE),
       "tied_logits": lambda: graphs.tied_logits(TABLE), "untied_logits": lambda: graphs.untied_logits(TABLE, HEAD),
       "scaled_lookup": lambda: graphs.scaled_lookup(TABLE),
       "neighbors_cosine": lambda: graphs.neighbors(TABLE, "cosine"),
       "neighbors_dot": lambda: graphs.neighbors(TABLE, "dot")}


@pytest.mark.parametrize("name", ALL)
def test_graph_reads_well_in_netron(name):
    model = ALL[name]()
    onnx.checker.check_model(model, full_check=True)
    graph = model.graph
    meta = {p.key: p.value for p in model.metadata_props}
    assert (meta["graph"], meta["vocab_size"], meta["width"]) == (name, str(V), str(D))
    assert meta["tied"] == ("true" if name == "tied_logits" else "false")
    assert all(n.name and n.doc_string for n in graph.node)
    assert len({n.name for n in graph.node}) == len(graph.node)
    io_dims = {d.dim_param for v in list(graph.input) + list(graph.output)
               for d in v.type.tensor_type.shape.dim if d.dim_param}
    assert io_dims <= {"batch", "seq", "n", "k"}
    weights = {t.name for t in graph.initializer}
    produced = {o for n in graph.node for o in n.output} - {o.name for o in graph.output}
    assert produced == {v.name for v in graph.value_info}  # every inner edge carries its shape
    assert not weights & {i.name for i in graph.input}  # no weight is an overridable input
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)  # our shapes agree with onnx's
    assert len(inferred.graph.value_info) >= len(graph.value_info)


# --- saving and exporting -----------------------------------------------------------------------------

def test_save_inline_and_external_load_and_run(tmp_path):
    model = graphs.tied_logits(TABLE)
    before = model.SerializeToString()
    inline = tmp_path / "inline.onnx"
    assert graphs.save(model, inline) == [str(inline)]
    external = tmp_path / "external.onnx"
    assert graphs.save(model, external, external=True) == [str(external), str(external) + ".data"]
    assert model.SerializeToString() == before  # the caller's model is not touched
    assert os.path.getsize(str(external) + ".data") >= TABLE.nbytes
    for path in (inline, external):
        out = ort.InferenceSession(str(path)).run(["embeddings"], {"ids": IDS, "hidden": HIDDEN})[0]
        assert np.array_equal(bits(out), bits(TABLE[IDS]))
    with pytest.raises(FileExistsError):
        graphs.save(model, inline)
    assert sorted(os.listdir(tmp_path)) == ["external.onnx", "external.onnx.data", "inline.onnx"]


@pytest.mark.slow
def test_save_a_2_gib_table_and_load_it(tmp_path):
    table = graphs.make_table(131072, 4096, seed=1)  # exactly 2**31 bytes: one past protobuf's limit
    assert table.nbytes == 2**31
    path = tmp_path / "big.onnx"
    written = graphs.save(graphs.gather_lookup(table), path)
    assert written == [str(path), str(path) + ".data"] and os.path.getsize(path) < 10_000
    ids = np.array([[0, 131071, 65536]], dtype=np.int64)
    options = ort.SessionOptions()
    (out,) = ort.InferenceSession(str(path), options).run(None, {"ids": ids})
    assert np.array_equal(bits(out), bits(table[ids]))


def export(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "graphs.export", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd or ROOT)


def test_export_writes_seven_graphs_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "models"
    done = export(out, "--vocab-size", 40, "--width", 6, "--seed", 2)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == sorted(FILES)
    tied = onnx.load(out / "tied_logits.onnx")
    assert np.array_equal(bits(numpy_helper.to_array(tied.graph.initializer[0])),
                          bits(np.array(embed.make_table(40, 6, 2), dtype=np.float32)))
    head = [t for t in onnx.load(out / "untied_logits.onnx").graph.initializer if t.name == "lm_head"][0]
    assert np.array_equal(bits(numpy_helper.to_array(head)), bits(np.array(embed.make_table(40, 6, 3), np.float32)))
    stamp = os.path.getmtime(out / "tied_logits.onnx")
    again = export(out)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--force" in again.stderr
    assert os.path.getmtime(out / "tied_logits.onnx") == stamp


def test_export_refuses_a_file_as_dir_and_bad_sizes(tmp_path):
    target = tmp_path / "file"
    target.write_text("mine")
    for args in ([target], [tmp_path / "x", "--vocab-size", 1], [tmp_path / "y", "--width", "w"]):
        done = export(*args)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert target.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["file"]


def test_check_sees_large_tables_as_holes_and_still_refuses_bad_models():
    model = graphs.tied_logits(graphs.make_table(4096, 256))  # a 4 MiB table: checked as external holes
    graphs.storage.check(model)
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[-1].input[0] = "nowhere"  # a graph error the full checker finds
    with pytest.raises(onnx.checker.ValidationError):
        graphs.storage.check(broken)
    short = onnx.ModelProto()
    short.CopyFrom(model)
    table = [t for t in short.graph.initializer if t.name == "embedding"][0]
    table.raw_data = table.raw_data[:-4]  # one value short: checked here, the checker never sees the bytes
    with pytest.raises(onnx.checker.ValidationError, match="bytes of raw data for dims"):
        graphs.storage.check(short)
