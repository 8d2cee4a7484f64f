"""One refreshed progress line on stderr, for the commands' long steps."""
import sys
import time


class Progress:
    """'[12.3 s] stage' on one refreshed stderr line, only when stderr is a terminal and `enabled` (compare: not
    when the JSON goes to stdout). `clean` makes a stage's text printable (inspect's stages name untrusted files)."""

    def __init__(self, enabled, clean=str):
        self.enabled, self.start, self.width = enabled and sys.stderr.isatty(), time.monotonic(), 0
        self.clean = clean

    def __call__(self, stage):
        if self.enabled:
            text = f"[{time.monotonic() - self.start:5.1f} s] {self.clean(stage)}"
            sys.stderr.write("\r" + text.ljust(self.width))
            sys.stderr.flush()
            self.width = len(text)

    def done(self):
        """Clear the line (before other output, and at the end)."""
        if self.enabled and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
            self.width = 0
