"""Run the lab's graphs in onnxruntime and check them against the reference in embed.py."""

__all__ = ["Runner", "run"]


def __getattr__(name):
    """Runner and run, imported from runtime.runner when first asked for: a command that only hands models to a
    child (runtime.inspect) never loads onnxruntime itself, so it writes nothing of its own (a $TMPDIR/.ses)."""
    if name in __all__:
        from runtime import runner
        return getattr(runner, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
