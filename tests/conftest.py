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


_DESELECTED, _SELECTED = [], set()


def pytest_deselected(items):
    _DESELECTED.extend(items)


def pytest_collection_finish(session):
    _SELECTED.update(item.path for item in session.items)


def pytest_terminal_summary(terminalreporter):
    """A file whose every test `-m` left out is named, with why: `pytest -m "not slow" tests/test_install.py`
    would otherwise end with "5 deselected" and nothing run, no word of the reason (issue 39)."""
    files = {}
    for item in _DESELECTED:
        files.setdefault(item.path, []).append(item)
    for path, items in sorted(files.items()):
        if path not in _SELECTED and all(i.get_closest_marker("slow") for i in items):
            terminalreporter.write_line(f"{path.name}: its {len(items)} test(s) are marked slow, so -m left them "
                                        "out (pytest.ini says why; -m slow runs them)")
