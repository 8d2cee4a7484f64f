"""python -m runtime.compare: build every graph, run it in onnxruntime, and check each claim against embed.py.

One line per check: PASS/FAIL (or N/A where the chosen inputs make a claim not apply), what was
compared, the measured difference and the tolerance used. Float32 scores are held to float32's
error bound for a sum of `width` products, |s - exact| <= gamma_w * sum|a_i b_i| with
gamma_w = w u / (1 - w u), u = 2**-24; lookups are held to the bit.

config: the command line as a frozen Config; reference: embed's answers, memoised on their arguments; sessions:
the graphs and their onnxruntime sessions; pool: the second process both use; bounds: float32's error bounds and
the Check record; lookups, heads, neighbors, formats, sizes: the checks, each check_x(config, reference, sessions);
cli: the command.
"""
from runtime.bounds import gamma
from runtime.compare.bounds import Check, within
from runtime.compare.cli import CHECKS
from runtime.compare.cli import main as _main
from runtime.compare.config import Config, parse
from runtime.compare.reference import Reference
from runtime.compare.sessions import Sessions

__all__ = ["CHECKS", "Check", "Config", "Reference", "Sessions", "gamma", "main", "parse", "within"]


def main(argv=None, impl=None):
    """Run the checks; 0 all pass, 1 any fails, 2 bad usage. `impl`: the reference implementation (default embed)."""
    import embed
    return _main(argv, description=__doc__.split("\n\n")[0].split(": ", 1)[1], impl=impl or embed)
