"""The README's example outputs of the operator commands are what the commands print today.

A crash demo is run and served (``readme_outputs.py``), the README's commands are run against
it, and each line of the README's blocks that gives the output its shape (titles, labels, table
headers; not the data rows, which differ from run to run) must be printed by the command, with
numbers and ids left out. Every title the command prints must be in the README too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .readme_outputs import COMMANDS, demo_coordinator, outputs

pytestmark = pytest.mark.timeout(900)

README = Path(__file__).resolve().parents[2] / "README.md"


def _skeleton(line: str) -> str:
    """The line without its values: every word holding a digit left out; a Gym instance line up
    to its staging keys (what follows names the slowest participants of the run)."""
    words = [w for w in line.split() if not re.search(r"\d", w)]
    if words[:1] == ["gym"]:
        cut = next((i for i, w in enumerate(words) if w.startswith("keys")), len(words))
        words = words[:cut] + ["keys"]
    return " ".join(words)


def _shape(text: str) -> tuple[list[str], set[str]]:
    """(titles, structural skeletons) of a command's output, its ``$`` line left out."""
    titles: list[str] = []
    shape: set[str] = set()
    in_table = False
    for line in text.splitlines()[1:]:
        if not line.strip():
            in_table = False
            continue
        if set(line.strip()) <= {"-", " "}:
            in_table = True  # the rows below a header's dashes are data
            continue
        if in_table or line.lstrip().startswith("…"):
            continue
        if not line.startswith(" "):
            titles.append(_skeleton(line))
        shape.add(_skeleton(line))
    return titles, shape


def _readme_block(command: str) -> str:
    blocks = re.findall(r"```\n(\$ CKPTC_RUN_TOKEN=\.\.\. ckpt-coordinator .*?)\n```", README.read_text(), flags=re.S)
    mine = [b for b in blocks if b.split()[3] == command]
    assert len(mine) == 1, f"the README shows {len(mine)} outputs of {command}"
    return mine[0]


def test_the_readme_shows_what_the_operator_commands_print() -> None:
    with demo_coordinator() as (url, run_id):
        printed = outputs(url, run_id)
    for command, extra in COMMANDS.items():
        shown = _readme_block(command)
        assert shown.splitlines()[0].split()[4:] == ["--url", shown.split()[5], "--run", shown.split()[7], *extra], shown.splitlines()[0]
        shown_titles, shown_shape = _shape(shown)
        titles, shape = _shape(printed[command])
        assert shown_shape <= shape, (command, sorted(shown_shape - shape), printed[command])
        assert set(titles) <= set(shown_titles), (command, sorted(set(titles) - set(shown_titles)))
