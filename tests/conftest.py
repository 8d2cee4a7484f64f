import sys

from tests.helpers import ROOT

if ROOT not in sys.path:  # so `pytest` from any folder imports the repo's packages
    sys.path.insert(0, ROOT)
