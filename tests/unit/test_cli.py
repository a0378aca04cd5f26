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


def test_a_bad_setting_is_named_and_its_value_never_printed(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CKPTC_ADMIN_TOKEN", "too-short-secret-value")
    monkeypatch.setenv("CKPTC_PORT", "99999")
    assert main(["migrate"]) == 2
    err = capsys.readouterr().err
    assert "CKPTC_ADMIN_TOKEN: CKPTC_ADMIN_TOKEN must be at least 32 characters" in err and "CKPTC_PORT" in err
    assert "too-short-secret-value" not in err and "99999" not in err
