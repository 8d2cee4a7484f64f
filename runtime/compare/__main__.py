import sys

from runtime.compare import main

sys.exit(main())
