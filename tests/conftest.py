import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # so `pytest` from any folder imports the repo's packages
    sys.path.insert(0, ROOT)
