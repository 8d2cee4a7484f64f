import os
import sys

from embed import run_cli
from runtime.compare import main
from runtime.compare.cli import huge_pages_env

env = huge_pages_env(sys.argv[1:])
if env is not None:  # once, with glibc's malloc on huge pages (see huge_pages_env)
    os.execve(sys.executable, [sys.executable, "-m", "runtime.compare", *sys.argv[1:]], env)
run_cli(main)
