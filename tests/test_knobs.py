"""A knob is declared once (hicache_core.gpu.knobs.Knob): its check, its environment variable, its effect."""

from __future__ import annotations

import pytest

from hicache_core.gpu.knobs import Knob, checked, knobs_of, read_knobs


class Tuned:
    width = Knob(checked(lambda v: isinstance(v, int) and v >= 1, "an int >= 1",
                         keep=lambda v: 1 << (v - 1).bit_length()),
                 env="WIDTH", minimum=1, doc="rounded up to a power of two")  # fmt: skip
    mode = Knob(checked(lambda v: v in (0, 1), "one of (0, 1)"), env="MODE",
                parse=lambda _, text: {"off": 0, "on": 1}[text], changed="_mode_changed")  # fmt: skip

    def __init__(self):
        self._width, self._mode, self.log = 4, 0, []

    def _reconfigure(self):
        self.log.append(("reconfigure", self._width))

    def _mode_changed(self):
        self.log.append(("mode", self._mode))


def test_a_set_is_checked_kept_and_followed_by_its_effect():
    t = Tuned()
    t.width = 5
    assert t.width == 8 and t.log == [("reconfigure", 8)]
    t.mode = 1
    assert t.log[-1] == ("mode", 1)
    with pytest.raises(ValueError, match=r"^width must be an int >= 1, got 0$"):
        t.width = 0
    assert t.width == 8
    assert Tuned.width.__doc__ == "rounded up to a power of two"
    assert [k.name for k in knobs_of(Tuned)] == ["width", "mode"]


def test_the_environment_goes_through_the_same_check(monkeypatch):
    monkeypatch.setenv("X_WIDTH", "3")
    monkeypatch.setenv("X_MODE", "on")
    t = Tuned()
    read_knobs(t, "X")
    assert (t.width, t.mode) == (4, 1)
    monkeypatch.setenv("X_WIDTH", "0")
    with pytest.raises(ValueError, match=r"^X_WIDTH='0' is not an integer >= 1$"):
        read_knobs(Tuned(), "X")
    monkeypatch.setenv("X_WIDTH", "wide")
    with pytest.raises(ValueError, match=r"^X_WIDTH='wide' is not an integer >= 1$"):
        read_knobs(Tuned(), "X")
    monkeypatch.setenv("X_WIDTH", " ")
    monkeypatch.delenv("X_MODE")
    t = Tuned()
    read_knobs(t, "X")
    assert (t.width, t.mode, t.log) == (4, 0, [])  # blank or unset: the value stays, nothing is redone


class Preset:
    size = Knob(checked(lambda v: isinstance(v, int) and v >= 1, "an int >= 1"), env="SIZE", minimum=1,
                default=2, changed=None)  # fmt: skip
    style = Knob(checked(lambda v: v in ("small", "large"), "'small' or 'large'"), env="STYLE",
                 parse=lambda _, text: text, preset=True, changed="_apply")  # fmt: skip

    def _apply(self):
        self._size = {"small": 1, "large": 64}[self._style]


def test_defaults_presets_first_and_variables_named_in_check_errors(monkeypatch):
    p = Preset()
    assert p.size == 2  # the declared default, checked once, until the first set
    assert [k.name for k in knobs_of(Preset)] == ["style", "size"]  # a preset is read before what it sets
    monkeypatch.setenv("P_STYLE", "large")
    monkeypatch.setenv("P_SIZE", "3")
    read_knobs(p, "P")
    assert (p.style, p.size) == ("large", 3)  # the variable overrides the preset's value
    monkeypatch.setenv("P_STYLE", "huge")
    with pytest.raises(ValueError, match=r"^P_STYLE='huge': style must be 'small' or 'large', got 'huge'$"):
        read_knobs(Preset(), "P")
    with pytest.raises(ValueError, match=r"^size must be an int >= 1, got 0$"):
        Knob(checked(lambda v: v >= 1, "an int >= 1"), default=0).__set_name__(Preset, "size")
