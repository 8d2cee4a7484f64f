import sys

from embed import Terminated, raise_on_sigterm, run_cli

PROG = "python -m runtime.inspect"
raise_on_sigterm()  # before the imports below take their half second: a signal then is one line too
try:
    from runtime.inspect.cli import main
except KeyboardInterrupt:
    print(f"{PROG}: interrupted; nothing done", file=sys.stderr)
    sys.exit(130)
except Terminated as e:
    print(e.line(PROG), file=sys.stderr)
    sys.exit(128 + e.signum)

run_cli(main, prog=PROG)
