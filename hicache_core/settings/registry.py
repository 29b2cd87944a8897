"""Every declared setting: the core's, and each plugin's and adapter's, found without importing them.

The core declares its variables in :mod:`hicache_core.settings.variables`; a plugin or an adapter names a light
module's list of :class:`~hicache_core.settings.Setting` in a ``hicache.settings`` entry point
(``kernel = "hicache_kernel.variables:SETTINGS"``). :func:`declared` gathers them (a variable declared
twice is an error); :func:`current` reads each from the environment for ``hicache settings``. A shell
script reads one through ``python -m hicache_core.settings.registry VARIABLE``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import Setting, SettingError, variables

#: The entry point group a plugin or adapter declares its settings in: ``name = "pkg.variables:SETTINGS"``.
ENTRY_POINT_GROUP = "hicache.settings"
CORE = "hicache-core"


class DeclarationError(RuntimeError):
    """Two declarations of one variable, or an entry point that does not name a list of settings."""


@dataclass(frozen=True)
class Declared:
    """A declared :class:`Setting` and who declares it (``hicache-core``, or a distribution's entry point)."""

    setting: Setting
    declared_by: str


def declared() -> dict[str, Declared]:
    """Every declared setting by variable name: the core's, then each ``hicache.settings`` entry point's.

    Imports only the declaring modules (no torch, no plugin implementation).

    :raises DeclarationError: a variable declared twice, or an entry point that does not load or is not
        a list of settings (the message names the distribution).
    """
    from importlib.metadata import entry_points

    sources: list[tuple[str, Any]] = [(CORE, variables.SETTINGS)]
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        owner = point.dist.name if point.dist is not None else point.name
        try:
            sources.append((owner, point.load()))
        except Exception as exc:  # a broken plugin is named, not a traceback of the whole listing
            raise DeclarationError(f"{owner}: its {ENTRY_POINT_GROUP} entry point {point.value} failed to load: "
                                   f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
    out: dict[str, Declared] = {}
    for owner, settings in sources:
        if not isinstance(settings, (list, tuple)) or not all(isinstance(s, Setting) for s in settings):
            raise DeclarationError(f"{owner}: its {ENTRY_POINT_GROUP} entry point must name a list of Setting")
        for setting in settings:
            if setting.name in out:
                first = out[setting.name].declared_by
                raise DeclarationError(f"{setting.name} is declared twice: by {first} and by {owner}")
            out[setting.name] = Declared(setting, owner)
    return out


@dataclass(frozen=True)
class Current:
    """One setting as it stands in an environment: its value, where that came from, or why it is refused."""

    name: str
    value: str
    source: str  # "environment" or "default"
    takes: str
    doc: str
    declared_by: str
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {"name": self.name, "value": self.value, "source": self.source, "takes": self.takes,
                "doc": self.doc, "declared_by": self.declared_by, "error": self.error}  # fmt: skip


def current(environ: Mapping[str, str] | None = None) -> list[Current]:
    """Every declared setting, sorted by name, as :func:`declared` finds them in ``environ`` (default ``os.environ``).

    A value the setting does not take is reported in :attr:`Current.error`, not raised.
    """
    rows = []
    for name, entry in sorted(declared().items()):
        setting = entry.setting
        source = "default" if setting.raw(environ) is None else "environment"
        error = None
        try:
            value = setting.read(environ)
            shown = "(unset)" if value is None else setting.show(value)
        except SettingError as exc:
            shown, error = "(refused)", str(exc)
        rows.append(Current(name, shown, source, setting.takes, setting.doc, entry.declared_by, error))
    return rows


def _main(argv: Sequence[str]) -> int:
    """``python -m hicache_core.settings.registry NAME``: the value of one declared setting for a shell script.

    Prints it (nothing where unset and without a default); a value the setting refuses, a name no
    one declares, or a secret setting (its value is never printed) exits 2 with the reason on stderr.
    """
    if len(argv) != 1:
        print("usage: python -m hicache_core.settings.registry VARIABLE", file=sys.stderr)
        return 2
    entry = declared().get(argv[0])
    if entry is None:
        print(f"{argv[0]} is not a declared setting (hicache settings lists them)", file=sys.stderr)
        return 2
    if entry.setting.secret:
        print(f"{argv[0]} is secret: it is never printed (hicache settings shows what may be shown of it)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        value = entry.setting.read()
    except SettingError as exc:
        print(exc, file=sys.stderr)
        return 2
    print("" if value is None else value)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
