"""float32's error bounds, the numeric facts compare's checks and inspect's retie proof both stand on: the unit
roundoff, Higham's gamma_n, gamma_w * sum|a_i b_i| for every row against every vector, MatMulNBits' bound
against the decoded table at its accuracy level, and what one more rounding to float16 / bfloat16 adds to two
float32 results, made upper bounds in float64."""
import numpy as np

U = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53  # float64's, for the reference's own arithmetic
# a narrower float format's unit roundoff and its smallest subnormal spacing (round to nearest: below the normal
# range a rounding moves a value by half that spacing at most, not by u of it)
NARROW = {"float16": (2.0**-11, 2.0**-24), "bfloat16": (2.0**-8, 2.0**-133)}


def gamma(n):
    """Higham's gamma_n: the relative bound on n float32 roundings in a row."""
    return n * U / (1 - n * U)


def unit_roundoff(dtype):
    """The unit roundoff of a float dtype's values (numpy's, or ml_dtypes' bfloat16): U for float32, U64 for
    float64, NARROW's for float16 and bfloat16."""
    name = np.dtype(dtype).name
    return {"float64": U64, "float32": U}.get(name) or NARROW[name][0]


def rounded_apart(apart, rounded, fmt):
    """How far apart two float32 results x, y lie once each is rounded to `fmt` (float16, bfloat16), given `apart`
    (an upper bound on |x - y|) and `rounded` (one of the two rounded values, fl(x)): per element.

    Rounding to nearest moves x by at most u|fl(x)| in the normal range (Higham's fl(x) = x / (1 + d), |d| <= u)
    and by half the subnormal spacing s below it, so |fl(x) - fl(y)| <= |x - y| + u|fl(x)| + u|fl(y)| + s, and
    with |fl(y)| <= |fl(x)| + |fl(x) - fl(y)|: (|x - y| + 2u|fl(x)| + s) / (1 - u). Inflated by 4 u64 for float64's
    own rounding of these few operations. Equal values (two infinities of one sign too) are the caller's to accept.
    """
    u, spacing = NARROW[fmt]
    return (as64(apart) + 2 * u * np.abs(as64(rounded)) + spacing) / (1 - u) * (1 + 4 * U64)


def bound_words(dtype):
    """The bound a head's output of `dtype` is proven within (inspect's retie proof), in words."""
    name = np.dtype(dtype).name
    if name not in NARROW:
        return "float32's rounding bound on its dot products"
    u, spacing = NARROW[name]
    return (f"its {name} bound (float32's on its dot products, then one rounding to {name}: "
            f"u = 2^{int(np.log2(u))} of the result, 2^{int(np.log2(spacing))} below its normal range)")


def as64(values):
    """`values` as a float64 array."""
    return np.asarray(values, dtype=np.float64)


def dot_bounds(rows, vectors, absolute=False):
    """gamma_w * sum|a_i b_i| for every row against every vector: (len(vectors), len(rows)); absolute=True says
    `rows` already holds |rows| in float64 (a caller asking many times keeps it).

    A tolerance, not a reference value, so float64 BLAS computes it: each |a_i b_i| of float32 values is exact in
    float64 and a sum of w non-negative terms is off by at most gamma_w in float64, so inflating by
    (1 + 2 (w + 2) u64) keeps it an upper bound on the exact gamma_w * sum|a_i b_i|.
    """
    rows, vectors = (rows if absolute else np.abs(as64(rows))), np.abs(as64(vectors))
    width = rows.shape[1]
    return gamma(width) * (vectors @ rows.T) * (1 + 2 * (width + 2) * U64)


def quantized_head_bound(hidden, table, block_size, accuracy_level):
    """Per logit, the float32 bound of MatMulNBits' hidden @ table.T against the exact sum over the decoded table
    (`table` [vocab, width] float64 values, the reference's decoded codes), for `hidden` [n, width].

    Level 0 decodes each code as code x scale in float32 (one rounding, as embed.dequantize, though perhaps another
    order: two values within u of one product are within 2u of each other) and sums float32 products:
    gamma_(w+2) sum|h t|. Level 4 also quantizes h to int8 per block b of the table's blocks, scale s_b =
    max|h_b| / 127, so each h_i moves by at most s_b / 2 (plus 2u|h_i| for the rounding of s_b and of h_i / s_b);
    the integer block sums are exact, then scaled and summed in float32 (gamma_(blocks+2) relative):
    sum_i (s_b(i) / 2 + 2u|h_i|) |t_i| + gamma_(blocks+2) sum|h^ t| + u sum|h t|, with |h^_i| <= |h_i| + that step.
    """
    h, t = np.abs(as64(hidden)), np.abs(as64(table))
    width = t.shape[1]
    if accuracy_level == 0:
        return gamma(width + 2) * (h @ t.T) * (1 + 2 * (width + 2) * U64)
    blocks = width // block_size
    scale = h.reshape(len(h), blocks, block_size).max(-1) / 127 * (1 + 2 * U)  # the float32 scale, rounded up
    step = np.repeat(scale / 2, block_size, axis=1) + 2 * U * h  # |h_i - h^_i| at most
    sums = np.concatenate([step, h + step, h]) @ t.T  # the three sums in one pass over the table
    n = len(h)
    bound = sums[:n] + gamma(blocks + 2) * sums[n:2 * n] + U * sums[2 * n:]
    return bound * (1 + 2 * (width + 2) * U64)  # float64's own rounding of these sums, kept an upper bound
