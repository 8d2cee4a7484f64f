"""float32's error bounds, the numeric facts compare's checks and inspect's retie proof both stand on: the unit
roundoff, Higham's gamma_n, and gamma_w * sum|a_i b_i| for every row against every vector, made an upper bound in
float64."""
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


