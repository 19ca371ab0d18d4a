"""Every pytest node an acceptance story runs (``tests/FILE.py::test_NAME[...]``) exists, so a
renamed or removed test fails here in CI instead of turning a story's criterion red later."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NODE = re.compile(r"(test_[A-Za-z0-9_]+\.py)::(test_[A-Za-z0-9_]+)")


def test_story_test_references_exist():
    stories = sorted((REPO / "cli" / "dgr" / "accept" / "stories").glob("dgr*.py"))
    assert stories
    missing, seen = [], 0
    for story in stories:
        for fname, test in NODE.findall(story.read_text()):
            seen += 1
            path = REPO / "tests" / fname
            if not path.is_file() or not re.search(rf"^(async )?def {test}\(", path.read_text(), re.M):
                missing.append(f"{story.name}: {fname}::{test}")
    assert seen > 20
    assert missing == []
