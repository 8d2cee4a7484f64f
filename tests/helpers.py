"""What the suites share: the repo's paths, the inspect command in a subprocess, its --json (cached for the
fixtures, which no test changes), the one-line-error rule, and small ONNX models built by hand."""
import functools
import json
import os
import subprocess
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
FOLDERS = os.path.join(FIXTURES, "folders")
U = 2.0**-24  # float32's unit roundoff
VOCAB, WIDTH, BLOCK = 512, 64, 32  # every model folder fixture's (make_genai_fixtures.py, make_more_*_fixtures.py)
TORCH_TABLE_BYTES = 256 * 32 * 4  # the torch exports' [256, 32] float32 table (make_torch_fixtures.py)
MADE = json.load(open(os.path.join(FIXTURES, "more_fixtures.json")))  # what made each make_more_* fixture


def run_inspect(*args, timeout=300, cwd=ROOT, **kwargs):
    """`python -m runtime.inspect ARGS` in a subprocess, as a user runs it: the CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", "runtime.inspect", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def inspect_cli(*args, **kwargs):
    """run_inspect's answer as (exit status, stdout, stderr)."""
    done = run_inspect(*args, **kwargs)
    return done.returncode, done.stdout, done.stderr


def inspected(*args, **kwargs):
    """run_inspect that must exit 0 (its stderr is the failure's message)."""
    done = run_inspect(*args, **kwargs)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def findings(path, *args):
    """`inspect PATH --json ARGS`, parsed. A fixture's answer is computed once a session (a fresh copy each call);
    anything else (a test's own files, which it may change between calls) is inspected every time."""
    path = os.path.abspath(str(path))
    if path.startswith(FIXTURES + os.sep):
        return json.loads(_fixture_json(path, args, _stamp(path)))
    return json.loads(inspected(path, "--json", *args).stdout)


def _stamp(path):
    """What would tell a changed fixture from the one cached: size and mtime of the file (or the folder's files)."""
    names = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    return tuple(sorted((n, os.stat(n).st_size, os.stat(n).st_mtime_ns) for n in names))


@functools.lru_cache(maxsize=None)
def _fixture_json(path, args, stamp):
    return inspected(path, "--json", *args).stdout


def model_in(name):
    """The model.onnx of fixture folder `name`."""
    return os.path.join(FIXTURES, name, "model.onnx")


def one_line_error(code, err, *words):
    """Exit 2 with exactly one line on stderr, no traceback, naming each of `words`."""
    return code == 2 and err.count("\n") == 1 and "Traceback" not in err and all(w in err for w in words)


def refused(done, *words):
    """one_line_error for a CompletedProcess."""
    return one_line_error(done.returncode, done.stderr, *words)


def relations(data):
    """(table, head, relation, wasted bytes) of each pair in a --json answer."""
    return [(p["table"], p["head"], p["relation"], p["wasted_bytes"]) for p in data["pairs"]]


def token_entry(data):
    """The one token table's vocabulary entry of a --json answer."""
    (entry,) = [v for v in data["vocabulary"] if v["kind"] == "token"]
    return entry


def model_of(nodes, inputs, outputs, initializers):
    graph = helper.make_graph(nodes, "hostile", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def head_through(nodes, table=None):
    """ids -> Gather(table); hidden -> MatMul(hidden, <the last of `nodes`>) -> logits."""
    import graphs
    table = graphs.make_table(16, 4) if table is None else table
    return model_of(
        [helper.make_node("Gather", ["embedding", "ids"], ["embeddings"])] + nodes
        + [helper.make_node("MatMul", ["hidden", nodes[-1].output[0] if nodes else "embedding"], ["logits"])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
         helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 16])],
        [numpy_helper.from_array(table, "embedding")])


def transposed_head(table=None):
    """A head reading its table through a Transpose: --retie has something to rewrite."""
    return head_through([helper.make_node("Transpose", ["embedding"], ["t"], perm=[1, 0])], table)


def many_tables(count):
    """`count` lookups and `count` heads, all of one shape and all different: count^2 pairs to relate."""
    rng = np.random.default_rng(0)
    nodes, initializers, outputs = [], [], []
    for i in range(count):
        initializers += [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), f"t{i}"),
                         numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), f"h{i}")]
        nodes += [helper.make_node("Gather", [f"t{i}", "ids"], [f"e{i}"]),
                  helper.make_node("MatMul", ["hidden", f"h{i}"], [f"l{i}"])]
        outputs += [helper.make_tensor_value_info(f"e{i}", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info(f"l{i}", TensorProto.FLOAT, None)]
    return model_of(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
                            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", 4])],
                    outputs, initializers)


def layered(layers, vocab=96, width=16):
    """A TorchScript-shaped tied decoder of `layers` layers: ids -> Gather(embedding) -> per layer a query weight
    read through a Transpose (onnxruntime folds it into a copy), an MLP up and down -> MatMul by `lm_head`, the
    table stored again transposed. Layer weights are named `layer{i}.{q,up,down}`; none has the table's size."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocab, width)).astype(np.float32)
    initializers = [numpy_helper.from_array(table, "embedding"),
                    numpy_helper.from_array(np.ascontiguousarray(table.T), "lm_head")]
    nodes, hidden = [helper.make_node("Gather", ["embedding", "ids"], ["h"])], "h"
    for i in range(layers):
        for part, dims in (("q", (width, width)), ("up", (width, 4 * width)), ("down", (4 * width, width))):
            name = f"layer{i}.{part}"
            initializers.append(numpy_helper.from_array(rng.standard_normal(dims).astype(np.float32), name))
            if part == "q":  # the weight stored [out, in], as torch keeps a Linear's
                nodes.append(helper.make_node("Transpose", [name], [f"{name}.t"], perm=[1, 0]))
            nodes.append(helper.make_node("MatMul", [hidden, f"{name}.t" if part == "q" else name], [f"{name}.out"]))
            hidden = f"{name}.out"
    nodes.append(helper.make_node("MatMul", [hidden, "lm_head"], ["logits"]))
    return model_of(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
                    [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab])],
                    initializers)


def tied(path, vocab=64, width=8, seed=0, external=False):
    """The lab's tied head saved at `path`."""
    import graphs
    graphs.save(graphs.tied_logits(graphs.make_table(vocab, width, seed)), path, external=external)
    return path


def renamed(model, old, new):
    """`model` with initializer `old` called `new`, and every node input reading it."""
    for tensor in model.graph.initializer:
        if tensor.name == old:
            tensor.name = new
    for node in model.graph.node:
        node.input[:] = [new if x == old else x for x in node.input]
    return model


def save_raw(model, path):
    """Write without any checker: these files are meant to be broken."""
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def folded(data):
    """The runtime copies onnxruntime's optimized model holds (not the ones kernels prepack at load)."""
    return [c for c in data["runtime_copies"] if c.get("view") != "prepacked"]


def unwrapped(text):
    """The report's logical lines: each continuation (indented four more than the line it continues, as
    runtime.inspect.answer.wrap writes it) joined back to its line with one space."""
    lines, indents = [], []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if lines and line.strip() and indent >= indents[-1] + 4:
            lines[-1] += " " + line.strip()
            continue
        lines.append(line)
        indents.append(indent)
    return lines


PROMPTS = ([1, 2, 3, 4], [17, 250, 3, 99, 400], [511, 7])  # token ids a generating client is given


def genai_tokens(folder, new=12):
    """Greedy tokens onnxruntime-genai's Generator picks after each prompt, in a child (it holds a session)."""
    script = f"""
import json, sys
import numpy as np
import onnxruntime_genai as og
model = og.Model(sys.argv[1])
tokens = []
for prompt in {list(PROMPTS)!r}:
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + {new}, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    tokens.append([int(t) for t in generator.get_sequence(0)][len(prompt):])
print(json.dumps(tokens))
"""
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
