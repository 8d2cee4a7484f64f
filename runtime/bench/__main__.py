from embed import run_cli
from runtime.bench.cli import main

run_cli(main, prog="python -m runtime.bench")
