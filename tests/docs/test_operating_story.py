"""The pages' stories are each one real run: output pasted from two runs (ports 40795 and 43419
in one failed-run story) reads as one and passes the doc tests, whose matching ignores numbers."""

from __future__ import annotations

import re

from tests.procs import ROOT


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start:end if end > 0 else None]


def test_each_story_of_operating_md_shows_one_chief():
    text = (ROOT / "docs/operating.md").read_text()
    waiting = _section(text, "### Pre-flight: `collective doctor`") + _section(text, "### During a run: `collective status`")
    failed = _section(text, "### A failed run, top to bottom")
    for story in (waiting, failed):
        ports = set(re.findall(r"chief at 127\.0\.0\.1:(\d+)|serving on 127\.0\.0\.1:(\d+)|^chief 127\.0\.0\.1:(\d+)|"
                               r"connect +127\.0\.0\.1:(\d+)", story, flags=re.M))
        assert len({p for group in ports for p in group if p}) == 1, ports
    incarnations = set(re.findall(r"as rank 0 of 2 \(incarnation (\w+)\)", failed))
    dates = set(re.findall(r"^(\d{4}-\d\d-\d\d) \(UTC\)$", failed, flags=re.M))
    assert len(incarnations) == 1 and len(dates) == 1, (incarnations, dates)
