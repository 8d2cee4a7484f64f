"""Run the lab's graphs in onnxruntime and check them against the reference in embed.py."""
from runtime.runner import Runner, run

__all__ = ["Runner", "run"]
