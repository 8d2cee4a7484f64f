"""float32's error bounds, the numeric facts compare's checks and inspect's retie proof both stand on: the unit
roundoff, Higham's gamma_n, gamma_w * sum|a_i b_i| for every row against every vector, and MatMulNBits' bound
against the decoded table at its accuracy level, made upper bounds in float64."""
import numpy as np

U = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53  # float64's, for the reference's own arithmetic


def gamma(n):
    """Higham's gamma_n: the relative bound on n float32 roundings in a row."""
    return n * U / (1 - n * U)


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
    bound = step @ t.T + gamma(blocks + 2) * ((h + step) @ t.T) + U * (h @ t.T)
    return bound * (1 + 2 * (width + 2) * U64)  # float64's own rounding of these sums, kept an upper bound
