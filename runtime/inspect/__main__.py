from embed import run_cli
from runtime.inspect.cli import main

run_cli(main, prog="python -m runtime.inspect")
