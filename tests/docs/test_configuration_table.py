"""The configuration table (docs/configuration.md) lists every setting, and names no setting that is gone."""

from __future__ import annotations

import re
from pathlib import Path

from checkpoint_coordinator.config import Settings

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# Variables of the table that are not service settings: the operator commands', the tests'.
NOT_SETTINGS = {"CKPTC_URL", "CKPTC_TEST_DATABASE_URL", "CKPTC_CI", "CKPTC_SKIP_IMAGE", "CKPTC_IMAGE_BASE_CACHE"}


def test_every_setting_is_in_the_configuration_table_and_every_row_is_a_setting() -> None:
    text = CONFIGURATION.read_text()
    table = text[text.index("## Settings"):text.index("## The run's recovery config")]
    rows = {v for line in table.splitlines() if line.startswith("| `CKPTC_") for v in re.findall(r"`(CKPTC_[A-Z0-9_]+)`", line.split("|")[1])}
    settings = {f"CKPTC_{name.upper()}" for name in Settings.model_fields}
    assert settings - rows == set(), "settings missing from the configuration table of docs/configuration.md"
    assert rows - settings - NOT_SETTINGS == set(), "rows of the table that are no setting"
