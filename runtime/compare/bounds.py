"""What every check measures against: float32's error bounds, bit comparisons, and the Check record."""
import math
import textwrap
from dataclasses import dataclass, field

import numpy as np

from runtime.bounds import U, U64, as64, dot_bounds, gamma

WIDTH = 120  # the report's lines, at most
INDENT = "       "  # --verbose: the details under their check's line


@dataclass
class Check:
    """One check's result. `claim` is what its report line says (the claim and, by the status, its verdict);
    `detail` the figures behind it (--verbose, and the JSON), `diff` against `tolerance` the measured difference."""
    name: str
    graph: str
    passed: bool | None  # None: the claim does not apply to the inputs chosen
    detail: str
    diff: float | None = None
    tolerance: float | None = None
    values: dict = field(default_factory=dict)
    info: bool = False  # a measured figure reported beside the checks (INFO), not a verdict
    claim: str = ""  # the line's words; empty: the detail's

    def __post_init__(self):
        if self.passed is not None:
            self.passed = bool(self.passed)  # a numpy bool is not `False`: counted by identity, it would pass

    def line(self):
        """The report line: status, check, graph and the claim, wrapped under itself past WIDTH characters."""
        status = "INFO" if self.info else {True: "PASS", False: "FAIL", None: "N/A "}[self.passed]
        head = f"{status} | {self.name:<13} | {self.graph:<22} | "
        parts = textwrap.wrap(self.claim or self.detail, WIDTH - len(head), break_on_hyphens=False) or [""]
        return "\n".join([head + parts[0]] + [" " * len(head) + part for part in parts[1:]])

    def details(self):
        """The lines --verbose prints under line(): the detail, then the measured difference and its tolerance."""
        lines = textwrap.wrap(self.detail, WIDTH, initial_indent=INDENT, subsequent_indent=INDENT,
                              break_on_hyphens=False) if self.claim else []
        if self.diff is not None:
            what = f" ({self.values['diff_is']})" if "diff_is" in self.values else ""
            lines.append(f"{INDENT}measured difference{what} {self.diff:.3g}, tolerance {self.tolerance:.3g}")
        return "\n".join(lines)


def differing_bits(a, b):
    """(values whose bits differ, of them a signed zero against the other zero) between a graph's output and the
    reference's floats: a sum of products turns the table's -0.0 into +0.0, equal as a value, so it is counted
    apart. Shapes that differ count every value."""
    a, b = as64(a), as64(b)
    if a.shape != b.shape:
        return max(a.size, b.size), 0
    bits = a.view(np.uint64) != b.view(np.uint64)
    zeros = bits & (a == 0) & (b == 0)
    return int(np.count_nonzero(bits & ~zeros)), int(np.count_nonzero(zeros))


def differing(a, b):
    """How many values differ in their bits (float32 graph output against float32-exact reference floats)."""
    return sum(differing_bits(a, b))


def differing_positions(got, want, scores, bounds):
    """Positions where two neighbour lists differ beyond a tie: exact, except where the reference scores of the two
    tokens lie within their bounds of each other (a length mismatch counts every missing position)."""
    return abs(len(got) - len(want)) + sum(g != w and abs(scores[g] - scores[w]) > bounds[g] + bounds[w]
                                           for g, w in zip(got, want))


def scaled_tolerances(width):
    """(relative bound of each value, of each norm ratio against sqrt(width), of |cosine - 1|) for rows times
    float32(sqrt(width)): two roundings of at most u each (the root, the product), and a float64 norm or cosine
    over `width` values; values off by <= 2u relative turn a cosine by <= (2u)^2 / 2."""
    return 2 * U * (1 + U), math.sqrt(width) * (2 * U * (1 + U) + (width + 4) * U64), 2 * U * U + (width + 4) * U64


def within(got, exact, bound):
    """(passed, max |diff|, worst diff / bound); NaN never passes."""
    got, exact, bound = as64(got), as64(exact), as64(bound)
    diff = np.abs(got - exact)
    ok = bool(np.all(diff <= bound)) and not np.isnan(got).any()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(diff == 0, 0.0, diff / bound)  # a difference against a zero bound is infinitely over
    return ok, float(np.max(diff)), float(np.max(ratio))  # NaN shows as nan in both


def _with_row(reference, values, factor, row_value):
    """`values` (one per row of the table), with the stretched row's entry recomputed for at(factor): a stretch
    changes one row, so no copy of the whole table is needed."""
    if factor is None:
        return values
    values = values.copy()
    values[reference.stretch] = row_value(as64(reference.at(factor)[reference.stretch]))
    return values


def dot_bound(reference, vector, factor=None):
    """gamma_w * sum|a_i b_i| of each row of reference.at(factor) against `vector`."""
    return _with_row(reference, dot_bounds(reference.magnitudes.abs64, [vector], absolute=True)[0], factor,
                     lambda row: dot_bounds([row], [vector])[0, 0])


def cosine_bound(reference, vector, cosines, factor=None):
    """The float32 bound of each cosine in `cosines` {token: reference cosine} of reference.at(factor)'s rows with
    `vector`: the dot's bound over the norms, plus gamma_(w+4) |cos| for the norms' sums, square roots, product
    and division. Norms here are float64 (a tolerance, not a reference value), deflated to keep the bound upper."""
    width = reference.config.width
    dots = dot_bound(reference, vector, factor)
    shrink = 1 - 2 * (width + 2) * U64
    norms = _with_row(reference, reference.magnitudes.norms64, factor, lambda row: np.sqrt(row @ row)) * shrink
    query = np.sqrt(np.dot(as64(vector), as64(vector))) * shrink
    return {t: dots[t] / (norms[t] * query) + gamma(width + 4) * abs(c) for t, c in cosines.items()}


def summary(checks):
    """(failed, the last line): the verdicts counted, and the INFO lines said for what they are."""
    failed = sum(c.passed is False for c in checks)
    figures = sum(c.info for c in checks)
    skipped = sum(c.passed is None for c in checks) - figures
    passed = len(checks) - failed - skipped - figures
    return failed, (f"{passed} passed, {failed} failed, {skipped} not applicable (of {len(checks) - figures} checks); "
                    f"{figures} INFO lines: figures measured, not verdicts")
