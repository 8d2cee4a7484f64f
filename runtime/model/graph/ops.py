"""The op facts inspect reasons with, written once: which ops multiply by a weight and how each reads it, and
which carry a product on to a graph output. The walker (graph.walk), --logits-to-keep (retie.keep), the proof's
bounds (sandbox.agree), the prefill timing (sandbox.timing) and --help (inspect.usage) read them from here."""
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
FUSED_MATMULS = ("MatMulIntegerToFloat",)  # onnxruntime's fusions in an optimized model (profiles name them)
PROFILED_MATMULS = tuple(MATMULS) + FUSED_MATMULS  # the kernels a profile's head time is summed over

VIEWS = ("Identity", "Reshape", "Cast", "Squeeze", "Unsqueeze")  # the values on, in another shape or type
SQUASHES = ("Tanh", "Softcap")  # soft-capped logits (Gemma2: 30 tanh(x / 30)): a change of at most the input's
SCALES = ("Add", "Sub", "Mul", "Div")  # a bias or a scale, when the other operand is a constant
CARRIES = VIEWS + SQUASHES  # what a logits product passes through to an output (with SCALES: reach.ScoredOutputs)
KEEPS_RANK = ("Identity", "Cast") + SQUASHES + SCALES  # elementwise: the sequence axis stays where it was
WITHIN_ITS_INPUT = ("Identity", "Tanh")  # a difference of inputs passes on at most as large (the proof's chains)

