"""A generated block of README.md (between its BEGIN and END markers), rendered from a record file: written, or
checked (the scripts' --check, which the tests run). Used by scripts/demo_table.py and scripts/ci_duration.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_text(begin: str, end: str, block: str) -> str:
    """README.md with the block between `begin` and `end` (markers included) replaced by `block`."""
    page = README.read_text()
    start, stop = page.index(begin), page.index(end) + len(end)
    return page[:start] + block + page[stop:]


def check(record: Path, render: Callable[[dict], str], begin: str, end: str, rerun: str) -> int:
    """Exit status of --check: 1 (saying what to run) when the README's block is not `record` rendered."""
    stale = README.read_text() != readme_text(begin, end, render(json.loads(record.read_text())))
    if stale:
        print(f"README.md's block {begin} is not {record.name}'s: run {rerun}", file=sys.stderr)
    return 1 if stale else 0
