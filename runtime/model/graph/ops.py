"""The op facts inspect reasons with, written once: which ops multiply by a weight and how each reads it, which
carry a product on to a graph output, which of their inputs hold scales or caches rather than parameters, and which
kernels prepack their weight. The walker (graph.walk), the weights branches share (graph.weights), the parameter
count (findings.shares), --logits-to-keep (retie.keep), the rewrites (retie.rewrite, retie.branches), the proof's
bounds (sandbox.agree), the probed packings (sandbox.probed), the feeds (runtime.feeds), the prefill timing
(sandbox.timing) and --help (inspect.usage) read them from here."""
from typing import NamedTuple


class Matmul(NamedTuple):
    """How a matmul reads its weight: the weight's input; the attribute that reads it transposed (None: stored
    [width, vocab] unless a Transpose precedes it); the inputs of its scales and zero point (None: none, or found past
    the op); its bits per code (None: a float weight); whether --logits-to-keep may slice the hidden state before
    it (it reads [batch, sequence, width], keeps that rank and scores each position alone)."""
    weight: int
    transposed: str | None = None
    scale: int | None = None
    zero_point: int | None = None
    bits: int | None = None
    sliceable: bool = True


MATMULS = {
    "MatMul": Matmul(1),
    "Gemm": Matmul(1, "transB", sliceable=False),  # 2-D only: a [batch, sequence, width] hidden state is flattened
    "FusedMatMul": Matmul(1, "transB"),
    "MatMulNBits": Matmul(1, scale=2, zero_point=3, bits=4),  # [N, K] blocks: rows are tokens; `bits` its default
    # 8-bit codes; the hidden state is quantized with one scale over all of it, so a slice would change its codes
    "MatMulInteger": Matmul(1, zero_point=3, bits=8, sliceable=False),  # the weight's scale multiplies its output
    "DynamicQuantizeMatMul": Matmul(1, scale=2, zero_point=3, bits=8, sliceable=False),
    "QLinearMatMul": Matmul(3, scale=4, zero_point=5, bits=8, sliceable=False),
}
INTEGER_MATMULS = ("MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul")  # 8-bit codes times a float scale
FLOAT_MATMULS = tuple(op for op in MATMULS if op not in INTEGER_MATMULS)  # float weights, or 4-bit blocks
PLAIN_MATMULS = ("MatMul", "Gemm")  # the ONNX-domain ones: a float weight at input 1, of the activations' type
TRANSPOSING = tuple(op for op, m in MATMULS.items() if m.transposed)  # those with a transB attribute
# onnxruntime's CPU kernels that prepack a constant weight at load (its defaults), and the input whose type the
# activations share: MatMul / Gemm / FusedMatMul (its fusion of the first two) one type T for all; MatMulNBits's
# activations are its scales' type. The integer matmuls pack too (their activations of another type: not here).
PACKING = {"MatMul": 1, "Gemm": 1, "FusedMatMul": 1, "MatMulNBits": 2}
FUSED_MATMULS = ("MatMulIntegerToFloat",)  # onnxruntime's fusions in an optimized model (profiles name them)
PROFILED_MATMULS = tuple(MATMULS) + FUSED_MATMULS  # the kernels a profile's head time is summed over

VIEWS = ("Identity", "Reshape", "Cast", "Squeeze", "Unsqueeze")  # the values on, in another shape or type
SQUASHES = ("Tanh", "Softcap")  # soft-capped logits (Gemma2: 30 tanh(x / 30)): a change of at most the input's
SCALES = ("Add", "Sub", "Mul", "Div")  # a bias or a scale, when the other operand is a constant
CARRIES = VIEWS + SQUASHES  # what a logits product passes through to an output (with SCALES: reach.ScoredOutputs)
KEEPS_RANK = ("Identity", "Cast") + SQUASHES + SCALES  # elementwise: the sequence axis stays where it was
WITHIN_ITS_INPUT = ("Identity", "Tanh")  # a difference of inputs passes on at most as large (the proof's chains)


# Inputs that hold quantization scales and zero points (not parameters), by op: the codes beside them are.
QUANT_INPUTS = {"DequantizeLinear": (1, 2), "MatMulNBits": (2, 3, 4), "GatherBlockQuantized": (2, 3),
                "MatMulInteger": (2, 3), "DynamicQuantizeMatMul": (2, 3), "QLinearMatMul": (1, 2, 4, 5, 6, 7),
                "MatMulIntegerToFloat": (2, 3, 4, 5)}
CACHE_INPUTS = {"GroupQueryAttention": (7, 8), "RotaryEmbedding": (2, 3)}  # rotary cos / sin tables, from config
