"""Settings (hicache_core.settings): read through one helper that names the variable and what it takes."""

from __future__ import annotations

import pytest

from hicache_core import settings
from hicache_core.pool.host_pool import VALIDATE
from hicache_core.verification.verify import VERIFY, verify_default


@pytest.mark.parametrize("raw, value", [("1", True), ("0", False), (" ON ", True), ("no", False), ("", False)])
def test_a_flag_takes_the_usual_words(raw, value, monkeypatch):
    monkeypatch.setenv("X_FLAG", raw)
    assert settings.flag("X_FLAG").read() is value


def test_unset_gives_the_default(monkeypatch):
    monkeypatch.delenv("X_N", raising=False)
    assert settings.integer("X_N", minimum=1, default=7).read() == 7
    assert settings.flag("X_N").read() is False
    assert settings.text("X_N").read() is None


@pytest.mark.parametrize("setting, raw, message", [
    (settings.flag("X"), "2", r"^X='2' is not 1 or 0 \(also true/yes/on or false/no/off\)$"),
    (settings.integer("X", minimum=1), "0", r"^X='0' is not an integer >= 1$"),
    (settings.integer("X", minimum=1), "1.5", r"^X='1.5' is not an integer >= 1$"),
    (settings.number("X", above=True, unit="seconds"), "0", r"^X='0' is not a number of seconds > 0$"),
    (settings.number("X", unit="GiB"), "nan", r"^X='nan' is not a number of GiB >= 0$"),
    (settings.number("X", unit="GiB"), "inf", r"^X='inf' is not a number of GiB >= 0$"),
    (settings.choice("X", ("sglang",)), "yes", r"^X='yes' is not one of: 'sglang'$"),
])  # fmt: skip
def test_a_value_it_does_not_take_names_the_variable_and_what_it_takes(setting, raw, message, monkeypatch):
    monkeypatch.setenv("X", raw)
    with pytest.raises(settings.SettingError, match=message):
        setting.read()


def test_numbers_and_choices_parse(monkeypatch):
    monkeypatch.setenv("X", " 0.5 ")
    assert settings.number("X", unit="GiB").read() == 0.5
    monkeypatch.setenv("X", "sglang")
    assert settings.choice("X", ("sglang",)).read() == "sglang"


def test_the_cores_flags_refuse_junk(monkeypatch):
    """HICACHE_VALIDATE / HICACHE_VERIFY used to read any value but '0' as on."""
    monkeypatch.setenv(VERIFY.name, "1")
    assert verify_default() is True
    monkeypatch.setenv(VERIFY.name, "maybe")
    with pytest.raises(settings.SettingError, match="^HICACHE_VERIFY='maybe' is not 1 or 0"):
        verify_default()
    monkeypatch.setenv(VALIDATE.name, "2")
    with pytest.raises(settings.SettingError, match="^HICACHE_VALIDATE='2' is not 1 or 0"):
        VALIDATE.read()
