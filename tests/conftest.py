import sys

import pytest

from tests.helpers import ROOT

if ROOT not in sys.path:  # so `pytest` from any folder imports the repo's packages
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """The lab's seven graphs at 64 x 8, saved once a session (the tests only read them)."""
    import graphs
    from graphs.export import build_all
    folder = tmp_path_factory.mktemp("lab")
    for name, model in build_all(64, 8, 0).items():
        graphs.save(model, folder / name)
    return folder
