"""The README and docs/ pages: their transcripts are what the commands print now (tests/transcripts.py replays them;
`--write` regenerates them when a change is meant), every relative link leads to a file (and heading) that exists,
and the README stays a front page."""
import os
import re

import pytest

from tests import transcripts

ROOT = transcripts.ROOT
BLOCKS = transcripts.all_blocks()
PAGES = transcripts.pages() + [os.path.join(ROOT, name) for name in ("BENCHMARKS.md", "CHANGELOG.md")]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_the_pages_hold_transcripts_to_check():
    readme = [body for path, _, body in BLOCKS if path == transcripts.README]
    assert any(body[0].startswith(transcripts.COMPARE) for body in readme)  # one per command on the front page
    assert any(body[0].startswith("$ ./lab_env/python -m runtime.inspect ") for body in readme)
    assert sum(body[0].startswith("$ ") for _, _, body in BLOCKS) >= 3


@pytest.mark.parametrize("path, start, body", BLOCKS, ids=[transcripts.where(p, s) for p, s, _ in BLOCKS])
def test_a_transcript_matches_a_run(path, start, body):
    assert transcripts.drift(body, transcripts.replay(body)) == "", f"{transcripts.where(path, start)} " \
        "(regenerate: ./lab_env/python tests/transcripts.py --write)"


def test_drift_is_found():
    body = ["$ ./lab_env/python -m runtime.inspect x.onnx", "a line", "  in memory: +2.1 MiB"]
    assert transcripts.drift(body, body[:2] + ["  in memory: +3.7 MiB"]) == ""  # a measured figure may move
    assert transcripts.drift(body, body[:1] + ["another line", body[2]]) != ""
    assert transcripts.drift(body, body + ["one more"]) != ""
    elided = body[:2] + ["...", "last"]
    assert transcripts.drift(elided, body[:2] + ["skipped", "last", "after"]) == ""


def test_a_block_is_found_in_docs_pages_with_its_place():
    assert transcripts.README in transcripts.pages()
    assert os.path.join(ROOT, "docs", "compare.md") in transcripts.pages()
    assert transcripts.where(os.path.join(ROOT, "docs", "inspect.md"), 7) == "docs/inspect.md:7"


def test_the_readme_is_a_front_page():
    lines = open(transcripts.README).read().split("\n")
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move the detail into a docs/ page"
    first_screen = "\n".join(lines[:45])  # what it is, how to run it, how to inspect a model
    for words in ("./lab_env/python -m runtime.compare", "./lab_env/python -m pytest", "runtime.inspect", "--retie"):
        assert words in first_screen, words


def slugs(text):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as '-'."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def prose(text):
    """The text outside fenced blocks (transcripts, commands), where links and headings are."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def links(path):
    return [(path, target) for target in LINK.findall(re.sub(r"`[^`\n]*`", "", prose(open(path).read())))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_leads_somewhere(page):
    bad = []
    for _, target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not this repository's
            continue
        file, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
        if not full.startswith(ROOT + os.sep) or not os.path.exists(full):
            bad.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in slugs(open(full).read()):
            bad.append(f"{target}: no heading #{anchor} in {os.path.relpath(full, ROOT)}")
    assert not bad, f"{os.path.relpath(page, ROOT)}: {bad}"


def test_the_link_check_sees_links():
    found = [target for _, target in links(transcripts.README)]
    assert "docs/compare.md" in found and "docs/inspect.md#versions" in found
    assert "how-the-tie-is-held-once-the-run-time-view" in slugs(open(os.path.join(ROOT, "docs", "export.md")).read())
    assert "--check-in-ci" in slugs("## `--check` in CI\n")
