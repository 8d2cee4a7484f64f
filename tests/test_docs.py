"""The README's transcripts are what the commands print now (tests/transcripts.py replays them; `--write`
regenerates them when a change is meant)."""
import pytest

from tests import transcripts

BLOCKS = transcripts.blocks(open(transcripts.README).read())


def test_the_readme_holds_transcripts_to_check():
    assert any(body[0].startswith(transcripts.COMPARE) for _, _, body in BLOCKS)
    assert sum(body[0].startswith("$ ") for _, _, body in BLOCKS) >= 3


@pytest.mark.parametrize("start, body", [(start, body) for start, _, body in BLOCKS], ids=lambda x: str(x)[:12])
def test_a_transcript_matches_a_run(start, body):
    assert transcripts.drift(body, transcripts.replay(body)) == "", f"README.md:{start} (regenerate: " \
        "./lab_env/python tests/transcripts.py --write)"


def test_drift_is_found():
    body = ["$ ./lab_env/python -m runtime.inspect x.onnx", "a line", "  in memory: +2.1 MiB"]
    assert transcripts.drift(body, body[:2] + ["  in memory: +3.7 MiB"]) == ""  # a measured figure may move
    assert transcripts.drift(body, body[:1] + ["another line", body[2]]) != ""
    assert transcripts.drift(body, body + ["one more"]) != ""
    elided = body[:2] + ["...", "last"]
    assert transcripts.drift(elided, body[:2] + ["skipped", "last", "after"]) == ""
