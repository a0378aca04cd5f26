"""Every command of ckpt-coordinator explains itself, and options reach the delegated commands."""

from __future__ import annotations

import pytest

from ckpt_launcher import main


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["migrate", "--help"], ["gymsim", "--help"], ["demo", "--help"], ["import-ledger", "--help"]])
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and len(out) > 100


def test_delegated_command_gets_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["demo", "--steps", "not-a-number"])
    assert e.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
