"""Jobs built by hand with sandbox.jobs' constructors, run by the real isolated child on a tiny model made with
onnx.helper, and the typed answers (sandbox.answers) checked against numbers computed here: the version of the
onnxruntime this process imports, the files at the paths the job named, the table's values in what was written."""
import os
import warnings

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

from runtime import feeds
from runtime.model.read.model import load
from runtime.inspect.sandbox import answers, isolated, jobs

VOCAB, WIDTH = 64, 8
LIMITS = 120  # seconds a child may take


def tied_model(path, transposed=True):
    """ids [batch, seq] -> Gather(embedding) -> embeddings; embeddings x head -> logits [batch, seq, VOCAB]. The
    head is Transpose(embedding) (a tied head, which onnxruntime's constant folding copies), else a head of its
    own stored [WIDTH, VOCAB]. Returns the table."""
    table = np.random.default_rng(0).standard_normal((VOCAB, WIDTH)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["embeddings"], name="lookup"),
             helper.make_node("MatMul", ["embeddings", "head"], ["logits"], name="scores")]
    weights = [numpy_helper.from_array(table, "embedding")]
    if transposed:
        nodes.insert(1, helper.make_node("Transpose", ["embedding"], ["head"], perm=[1, 0], name="tie"))
    else:
        weights.append(numpy_helper.from_array(np.ascontiguousarray(table.T) * 2, "head"))
    graph = helper.make_graph(
        nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", "seq", WIDTH]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", VOCAB])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return table


def _checked(tmp_path, transposed=True):
    """(the Model of a tied_model at tmp_path, its table, the decoder feeds' rows and shape, a scratch folder)."""
    table = tied_model(tmp_path / "m.onnx", transposed)
    model = load(str(tmp_path / "m.onnx"))
    folder = tmp_path / "scratch"
    folder.mkdir()
    return model, table, {"ids": VOCAB}, feeds.plan(model.proto, model.path), str(folder)


def _tensors(path):
    """{name: values} of every initializer of the model at `path`, its external data read."""
    with warnings.catch_warnings():  # the prepacked copies onnxruntime records are external data keys onnx warns of
        warnings.simplefilter("ignore", UserWarning)
        return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


def _added_up(figures):
    """A session's resident growth is its anonymous and file-backed growth, read at the same moment."""
    return figures.resident_bytes == figures.anonymous_bytes + figures.file_bytes


def test_optimize_with_data_writes_the_tables_copy(tmp_path):
    model, table, _, _, folder = _checked(tmp_path)
    out = os.path.join(folder, "optimized.onnx")
    answer = isolated.call(jobs.optimize(jobs.user_model(model.checked), out, folder), "optimizing",
                           isolated.Limits(LIMITS), model.file_bytes)
    assert type(answer) is answers.Optimized
    assert answer.onnxruntime == onnxruntime.__version__
    assert answer.data is True and os.path.exists(out)
    written = _tensors(out)  # the folded Transpose: the table's values, transposed, bit for bit
    assert any(v.shape == (WIDTH, VOCAB) and np.array_equal(v, table.T) for v in written.values())


def test_optimize_for_the_layout_tells_the_copy_by_its_node(tmp_path):
    model, _, _, _, folder = _checked(tmp_path)
    out = os.path.join(folder, "layout.onnx")
    answer = isolated.call(jobs.optimize(jobs.user_model(model.checked), out, folder, sizes=[VOCAB * WIDTH]),
                           "optimizing", isolated.Limits(LIMITS), model.file_bytes)
    assert answer.onnxruntime == onnxruntime.__version__
    assert (answer.data, answer.written) == (False, True) and os.path.exists(out)
    assert [(c["of"], c["view"]) for c in answer.folded.values()] == [("embedding", "transposed")]
    assert not [n for n in os.listdir(folder) if n.startswith("layout.onnx.")]  # no data file beside it
    assert (answer.owned_bytes, answer.originals, answer.unrecorded) == (None, None, None)


def test_optimize_without_a_copy_writes_the_layout_alone(tmp_path):
    model, _, _, _, folder = _checked(tmp_path, transposed=False)
    out = os.path.join(folder, "layout.onnx")
    answer = isolated.call(jobs.optimize(jobs.user_model(model.checked), out, folder, sizes=[VOCAB * WIDTH]),
                           "optimizing", isolated.Limits(LIMITS), model.file_bytes)
    assert (answer.data, answer.written, answer.folded) == (False, False, None) and os.path.exists(out)


def test_measure_gives_figures_and_the_layout_it_wrote(tmp_path):
    model, _, rows, shape, folder = _checked(tmp_path)
    source = jobs.user_model(model.checked)
    alone = isolated.call(jobs.measure(source, folder, rows, shape), "measuring", isolated.Limits(LIMITS),
                          model.file_bytes)
    assert type(alone) is answers.Measured and alone.optimized is None and _added_up(alone.figures)
    layout = os.path.join(folder, "layout.onnx")
    answer = isolated.call(jobs.measure(source, folder, rows, shape, layout=layout, sizes=[VOCAB * WIDTH]),
                           "measuring", isolated.Limits(LIMITS), model.file_bytes)
    assert _added_up(answer.figures) and answer.figures.kept_bytes >= 0
    assert answer.optimized.onnxruntime == onnxruntime.__version__ and os.path.exists(layout)
    assert answer.optimized.data is False and answer.optimized.owned_bytes >= 0


def test_measure_together_gives_a_layout_per_part(tmp_path):
    model, _, rows, shape, folder = _checked(tmp_path)
    layouts = [os.path.join(folder, f"layout{i}.onnx") for i in range(2)]
    parts = [jobs.part(jobs.user_model(model.checked), rows, shape, layouts[0], [VOCAB * WIDTH]),
             jobs.part(jobs.user_model(model.checked), rows, shape)]  # the second writes none
    answer = isolated.call(jobs.measure_together(parts, folder, True), "measuring together",
                           isolated.Limits(LIMITS), 2 * model.file_bytes)
    assert type(answer) is answers.Together and type(answer.figures) is answers.Figures
    assert answer.layouts[1] is None and len(answer.layouts) == 2
    assert answer.layouts[0].onnxruntime == onnxruntime.__version__ and os.path.exists(layouts[0])
    assert not os.path.exists(layouts[1])


def test_prefill_times_the_run_and_its_head(tmp_path):
    model, _, rows, shape, folder = _checked(tmp_path)
    answer = isolated.call(jobs.prefill(model.checked, folder, rows, shape, 16, [VOCAB]), "timing",
                           isolated.Limits(LIMITS), model.file_bytes)
    assert type(answer) is answers.Timed and answer.why is None
    assert 0 <= answer.head_seconds <= answer.run_seconds and answer.run_seconds > 0  # a µs clock: a head may read 0
    assert answer.entry() == {"run_seconds": answer.run_seconds, "head_seconds": answer.head_seconds}


def test_prove_of_a_model_against_itself_finds_nothing(tmp_path):
    model, _, rows, shape, folder = _checked(tmp_path, transposed=False)
    layout = os.path.join(folder, "proved.onnx")
    proof = jobs.Proof(model.path, model.checked, model.path, [], rows, shape, layout=layout,
                       sizes=[VOCAB * WIDTH], measure=True)
    answer = isolated.call(jobs.prove(proof, folder), "proving", isolated.Limits(LIMITS), model.file_bytes)
    assert type(answer) is answers.Proved and (answer.failures, answer.original) == ([], None)
    assert _added_up(answer.measured) and os.path.exists(layout)
    assert answer.optimized.onnxruntime == onnxruntime.__version__ and answer.optimized.data is False


def test_a_wire_object_is_made_again_as_it_was():
    figures = answers.Figures(10, 6, 4, None, 0)
    optimized = answers.Optimized("1.0", False, True, {"t": {"of": "e", "view": "same"}}, 3, None,
                                  answers.Unrecorded("why", [{"initializer": "e"}]))
    for kind, answer in [("measure", answers.Measured(figures, optimized)), ("measure", answers.Measured(figures)),
                         ("measure_together", answers.Together(figures, [optimized, None])),
                         ("prove", answers.Proved(["a failure"], measured=figures, optimized=optimized)),
                         ("head_lookup", answers.LookedUp([answers.RowsChecked("e", False, 3)],
                                                          answers.Agreement(8, 128, 120, 8, 0.5, "fixed ids")))]:
        assert answers.of(kind, answers.wire(answer)) == answer
