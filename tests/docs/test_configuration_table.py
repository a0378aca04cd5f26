"""The README's configuration table lists every setting, and names no setting that is gone."""

from __future__ import annotations

import re
from pathlib import Path

from checkpoint_coordinator.config import Settings

README = Path(__file__).resolve().parents[2] / "README.md"
# Variables of the table that are not service settings: the operator commands', the tests'.
NOT_SETTINGS = {"CKPTC_URL", "CKPTC_TEST_DATABASE_URL", "CKPTC_CI", "CKPTC_SKIP_IMAGE", "CKPTC_IMAGE_BASE_CACHE"}


def test_every_setting_is_in_the_configuration_table_and_every_row_is_a_setting() -> None:
    text = README.read_text()
    table = text[text.index("## Configuration"):text.index("## Limits")]
    rows = {v for line in table.splitlines() if line.startswith("| `CKPTC_") for v in re.findall(r"`(CKPTC_[A-Z0-9_]+)`", line.split("|")[1])}
    settings = {f"CKPTC_{name.upper()}" for name in Settings.model_fields}
    assert settings - rows == set(), "settings missing from the README's configuration table"
    assert rows - settings - NOT_SETTINGS == set(), "rows of the table that are no setting"
