"""Replace one ``## `` section of docs/benchmarks.md with a benchmark's fresh report."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def write_section(section: str, text: str, docs: Path = DOCS) -> None:
    """Replace the section whose heading line is ``section`` (or append it) with ``text``."""
    current = docs.read_text() if docs.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(current):
        updated = pattern.sub(lambda _: text + "\n", current, count=1)
    else:
        updated = current.rstrip("\n") + "\n\n" + text
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(updated.rstrip("\n") + "\n")
