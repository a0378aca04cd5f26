"""Every page the code and the docs cite is a file of the repository, and every anchor a heading.

Comments cite ``docs/<page>.md#<anchor>``; the Markdown files link each other relatively. A cited
page that does not exist, an anchor no heading makes, or a path outside the repository (the
design brief the project grew from is not part of a clone) fails here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_CITED = re.compile(r"(?<![\w./-])docs/([\w-]+\.md)(?:#([\w-]+))?")
_MD_LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]+?\.md)(?:#([\w-]+))?\)")
_OUTSIDE = re.compile(r"shared/spec|\.\./shared/")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True)
    me = Path(__file__).resolve()
    return [
        ROOT / p for p in out.stdout.splitlines()
        if p.endswith((".py", ".md", ".yaml", ".yml", ".toml")) and (ROOT / p).is_file() and (ROOT / p).resolve() != me
    ]


def slugs(md: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings (code blocks skipped, repeats numbered)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        s = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_citations(files: list[Path]) -> list[str]:
    anchors: dict[Path, set[str]] = {}
    bad = []
    for f in files:
        text = f.read_text(errors="replace")
        rel = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name
        targets = [(ROOT / "docs" / page, anchor) for page, anchor in _CITED.findall(text)]
        if f.suffix == ".md":
            targets += [((f.parent / page).resolve(), anchor) for page, anchor in _MD_LINK.findall(text)]
        for page, anchor in targets:
            if not page.is_file():
                bad.append(f"{rel}: {page.relative_to(ROOT) if page.is_relative_to(ROOT) else page} does not exist")
            elif anchor and anchor not in anchors.setdefault(page, slugs(page)):
                bad.append(f"{rel}: {page.relative_to(ROOT)}#{anchor}: no such heading")
        if _OUTSIDE.search(text):
            bad.append(f"{rel}: names a path outside the repository")
    return bad


def test_every_cited_page_and_anchor_exists() -> None:
    files = _tracked()
    assert any(f.name == "architecture.md" for f in files)
    bad = broken_citations(files)
    assert not bad, "\n".join(sorted(set(bad)))


def test_a_broken_citation_is_seen(tmp_path: Path) -> None:
    probe = tmp_path / "probe.md"
    probe.write_text("See docs/ledger.md#no-such-heading, [x](nowhere.md), docs/missing.md and ../shared/spec.\n")
    assert len(broken_citations([probe])) == 4, broken_citations([probe])
