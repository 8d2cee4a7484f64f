import sys

from runtime.inspect.cli import main

sys.exit(main())
