"""Code the docs show as an excerpt of an example is that example's code, line for line: a block
after ``<!-- excerpt: PATH -->`` must be a run of consecutive lines of PATH, so the docs never show
code that does not run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "clients" / "ckpt_client" / "README.md"]
EXCERPT = re.compile(r"<!-- excerpt: (\S+) -->\n```[a-z]*\n(.*?)\n```", re.S)


def _excerpts() -> list[tuple[str, str, str]]:
    return [(doc.name, path, block) for doc in DOCS for path, block in EXCERPT.findall(doc.read_text())]


def test_the_readme_shows_excerpts_of_the_example() -> None:
    assert len([e for e in _excerpts() if e[0] == "README.md"]) >= 3


@pytest.mark.parametrize("doc,path,block", _excerpts(), ids=lambda v: v if len(v) < 40 else v[:40])
def test_an_excerpt_is_the_example_s_code(doc: str, path: str, block: str) -> None:
    source = (ROOT / path).read_text().splitlines()
    lines = block.splitlines()
    starts = [i for i, line in enumerate(source) if line == lines[0]]
    assert any(source[i : i + len(lines)] == lines for i in starts), f"{doc}: this excerpt is not in {path}:\n{block}"
