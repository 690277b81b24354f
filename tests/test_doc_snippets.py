"""Snippets of the docs that a reader copies as they are run here as written (no name they use left undefined)."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _snippet(doc: str, containing: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / doc).read_text(), re.S)
    matching = [block for block in blocks if containing in block]
    assert len(matching) == 1, f"{doc}: {len(matching)} python blocks contain {containing!r}"
    return matching[0]


def test_reliability_hang_timeout_snippet_runs():
    namespace: dict = {}
    exec(compile(_snippet("reliability.md", "hang_timeout=timedelta"), "docs/reliability.md", "exec"), namespace)
    assert namespace["timedelta"](minutes=20).total_seconds() == 1200
