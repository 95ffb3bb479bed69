"""docs/data.md and docs/quickstart.md show rows users copy: each is the format its heading says, by detect_format."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest

from posttrain.data import detect_format

DOCS = Path(__file__).resolve().parents[2] / "docs"
KINDS = {"language modeling": "language_modeling", "prompt-completion": "prompt_completion",
         "preference": "preference", "prompt-only": "prompt_only"}


def rows_under_headings(page: str) -> list[tuple[str, list[dict]]]:
    """(the line before each ```jsonl block, its rows)."""
    found = []
    for match in re.finditer(r"([^\n]+)\n\n```jsonl\n(.*?)```", page, re.S):
        found.append((match.group(1), [json.loads(line) for line in match.group(2).splitlines() if line.strip()]))
    return found


@pytest.mark.parametrize("heading, rows", rows_under_headings((DOCS / "data.md").read_text()))
def test_each_row_in_docs_data_is_the_format_its_heading_names(heading, rows):
    fmt = detect_format(datasets.Dataset.from_list(rows), heading)
    kind = next(KINDS[name] for name in KINDS if heading.lower().startswith(name))
    assert fmt.kind == kind, heading
    assert fmt.conversational == ("conversational" in heading.lower() or "implicit" in heading.lower()), heading
    assert fmt.implicit_prompt == ("implicit" in heading.lower()), heading


def test_the_quickstart_data_files_are_valid():
    page = (DOCS / "quickstart.md").read_text()
    files = re.findall(r"cat > (mydata/\S+\.jsonl) <<'EOF'\n(.*?)\nEOF", page, re.S)
    assert len(files) == 3
    for name, text in files:
        rows = [json.loads(line) for line in text.splitlines()]
        detect_format(datasets.Dataset.from_list(rows), name)
