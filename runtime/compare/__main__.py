from embed import run_cli
from runtime.compare import main

run_cli(main, prog="python -m runtime.compare")
