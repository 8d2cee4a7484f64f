"""Tied models at the sizes people ship, generated straight to disk: `python -m runtime.bench.scale_model OUT.onnx
--gib 3` writes a TorchScript-shaped tied decoder (a Gather on a vocab x width float32 table, blocks of MatMul /
Relu / MatMul / Add with random weights, and a MatMul head holding the table again, transposed) or, with
`--form shared`, the genai-like form (the head a Gemm(transB=1) reading the table itself), its weights in one
external data file, written a block at a time: the model is never held in memory. `--form layered` is shaped like
the exports people ship: each block a transformer-like layer (single-head attention, its q, k, v and o [width,
width] weights, then the MLP's up and down) and the TorchScript head; below 2 GiB it is one inline protobuf, as
Optimum writes every model that fits, above it its weights lie in the external data file."""
import argparse
import os

import numpy as np
from onnx import TensorProto, helper

from graphs.outputs import check_output
from graphs.storage import ALIGN

FORMS = ("torchscript", "shared", "layered")
INLINE_BELOW = 2**31 - 2**26  # a layered model this small is written inline (the protobuf's 2 GiB, less room)
VOCAB, WIDTH, HIDDEN = 128256, 2048, 8192  # Llama 3's vocabulary and a 1B model's widths
_CHUNK = 64 * 2**20  # bytes generated and written at a time


def blocks_for(gib, vocab=VOCAB, width=WIDTH, hidden=HIDDEN, form="torchscript"):
    """How many MatMul/Relu/MatMul/Add blocks bring the model nearest `gib` GiB (at least one)."""
    tables = vocab * width * 4 * (1 if form == "shared" else 2)
    block = (2 * width * hidden + (4 * width * width if form == "layered" else 0)) * 4
    return max(1, round((gib * 2**30 - tables) / block))


def generate(path, blocks, vocab=VOCAB, width=WIDTH, hidden=HIDDEN, form="torchscript", seed=0):
    """Write the model to `path` and its weights to `path`.data; returns the bytes of weights written."""
    if form not in FORMS:
        raise ValueError(f"form {form!r}: want one of {', '.join(FORMS)}")
    rng = np.random.default_rng(seed)
    data_name = os.path.basename(path) + ".data"
    initializers, nodes = [], []
    with open(os.path.join(os.path.dirname(os.path.abspath(path)), data_name), "wb") as data:
        def external(name, dims, fill):
            offset = data.tell() + (-data.tell() % ALIGN)
            data.seek(offset)
            fill(data)
            tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims)
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(data.tell() - offset))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            initializers.append(tensor)

        def random(rows, cols, scale):
            def fill(f):
                step = max(1, _CHUNK // (4 * cols))
                for start in range(0, rows, step):
                    part = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
                    f.write((part * np.float32(scale)).data)
            return fill

        external("embed.weight", [vocab, width], random(vocab, width, 0.02))
        table_at = int(initializers[0].external_data[1].value)
        nodes.append(helper.make_node("Gather", ["embed.weight", "input_ids"], ["h0"], name="embed"))
        for i in range(blocks):
            if form == "layered":
                for w in ("q", "k", "v", "o"):
                    external(f"layers.{i}.attn.{w}", [width, width], random(width, width, width ** -0.5))
                nodes += _attention(i)
            external(f"blocks.{i}.up", [width, hidden], random(width, hidden, width ** -0.5))
            external(f"blocks.{i}.down", [hidden, width], random(hidden, width, hidden ** -0.5))
            nodes += _mlp(i, f"a{i}" if form == "layered" else f"h{i}")
        last = f"h{blocks}"
        if form != "shared":
            def transposed(f):  # the table's columns, a block of them at a time, as rows of the head
                data.flush()
                table = np.memmap(data.name, np.float32, "r", offset=table_at, shape=(vocab, width))
                step = max(1, _CHUNK // (4 * vocab))
                for start in range(0, width, step):
                    f.write(np.ascontiguousarray(table[:, start:start + step].T).data)
                del table
            external("onnx::MatMul_head", [width, vocab], transposed)
            nodes.append(helper.make_node("MatMul", [last, "onnx::MatMul_head"], ["logits"], name="lm_head"))
        else:
            nodes.append(helper.make_node("Gemm", [last, "embed.weight"], ["logits"], name="lm_head", transB=1))
        written = data.tell()
    if form == "layered":
        initializers.append(helper.make_tensor("attn_scale", TensorProto.FLOAT, [], [width ** -0.5]))
    model = _model(nodes, initializers, form, vocab)
    if form == "layered" and written < INLINE_BELOW:
        _inline(model, os.path.join(os.path.dirname(os.path.abspath(path)), data_name))
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return written


def _model(nodes, initializers, form, vocab):
    """The ModelProto of `nodes` and `initializers`: ids [batch, sequence] (the shared form: [tokens]) to logits."""
    hidden_shape = ["tokens"] if form == "shared" else ["batch", "sequence"]
    graph = helper.make_graph(
        nodes, f"scale_{form}", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, hidden_shape)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, hidden_shape + [vocab])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnx-lab scale")
    model.ir_version = 8
    return model


def _mlp(i, before):
    """Block i's MatMul / Relu / MatMul on `before`, added back: h{i + 1}."""
    return [helper.make_node("MatMul", [before, f"blocks.{i}.up"], [f"u{i}"], name=f"up{i}"),
            helper.make_node("Relu", [f"u{i}"], [f"r{i}"], name=f"relu{i}"),
            helper.make_node("MatMul", [f"r{i}", f"blocks.{i}.down"], [f"d{i}"], name=f"down{i}"),
            helper.make_node("Add", [before, f"d{i}"], [f"h{i + 1}"], name=f"residual{i}")]


def _attention(i):
    """Layer i's single-head attention on h{i}: softmax(q k^T / sqrt(width)) v, then o, added back: a{i}."""
    h, p = f"h{i}", f"attn{i}_"
    return [helper.make_node("MatMul", [h, f"layers.{i}.attn.{w}"], [p + w], name=p + w) for w in ("q", "k", "v")] + [
        helper.make_node("Transpose", [p + "k"], [p + "kt"], name=p + "kt", perm=[0, 2, 1]),  # (batch, width, seq)
        helper.make_node("MatMul", [p + "q", p + "kt"], [p + "scores"], name=p + "scores"),  # (batch, seq, seq)
        helper.make_node("Mul", [p + "scores", "attn_scale"], [p + "scaled"], name=p + "scaled"),
        helper.make_node("Softmax", [p + "scaled"], [p + "weights"], name=p + "softmax", axis=-1),
        helper.make_node("MatMul", [p + "weights", p + "v"], [p + "mixed"], name=p + "mixed"),  # (batch, seq, width)
        helper.make_node("MatMul", [p + "mixed", f"layers.{i}.attn.o"], [p + "out"], name=p + "o"),
        helper.make_node("Add", [h, p + "out"], [f"a{i}"], name=p + "residual")]


def _inline(model, data_path):
    """Move every external tensor of `model` into the protobuf and remove the data file: one inline model file."""
    with open(data_path, "rb") as data:
        for tensor in model.graph.initializer:
            if tensor.data_location != TensorProto.EXTERNAL:
                continue
            where = {e.key: e.value for e in tensor.external_data}
            data.seek(int(where["offset"]))
            tensor.raw_data = data.read(int(where["length"]))
            del tensor.external_data[:]
            tensor.data_location = TensorProto.DEFAULT
    os.remove(data_path)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m runtime.bench.scale_model", description=__doc__)
    parser.add_argument("out", metavar="OUT.onnx")
    parser.add_argument("--gib", type=float, default=3.0, help="the model's size in GiB (default 3)")
    parser.add_argument("--form", choices=FORMS, default="torchscript")
    parser.add_argument("--vocab-size", type=int, default=VOCAB)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        check_output(args.out, "OUT")
    except ValueError as e:
        parser.error(str(e))
    blocks = blocks_for(args.gib, args.vocab_size, args.width, args.hidden, args.form)
    written = generate(args.out, blocks, args.vocab_size, args.width, args.hidden, args.form, args.seed)
    print(f"{args.out}: {args.form}, {blocks} block(s), {written / 2**30:.2f} GiB of weights")


if __name__ == "__main__":
    main()
