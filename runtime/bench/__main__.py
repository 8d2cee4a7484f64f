import sys

from runtime.bench.cli import main

sys.exit(main())
