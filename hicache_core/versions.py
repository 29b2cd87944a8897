"""hicache-core's version, and whether a plugin's required range admits it (docs/plugins.md, "Versions").

A plugin pins the range of hicache-core it was written for in its distribution's dependencies
(``hicache-core>=0.3,<0.4``). Installs that skip dependency resolution (``--no-deps``, editable
trees) can still put a plugin beside a core outside that range, so the registry checks it at
load and ``hicache plugins`` shows it. The specifiers read are PEP 440's comparison operators
over release numbers; anything else is reported as not checked, never guessed.
"""

from __future__ import annotations

import re
from importlib import metadata

#: This tree's version (the distribution's metadata wins where it is installed).
CORE_VERSION = "0.3.0"
CORE_DISTRIBUTION = "hicache-core"

_REQUIREMENT = re.compile(r"^\s*hicache[-_.]core\s*(?:\[[^\]]*\])?\s*\(?([^;)]*)\)?\s*(;.*)?$", re.IGNORECASE)
_CLAUSE = re.compile(r"^\s*(~=|==|!=|<=|>=|<|>)\s*([0-9]+(?:\.[0-9]+)*)(\.\*)?\s*$")


def core_version() -> str:
    try:
        return metadata.version(CORE_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return CORE_VERSION


def core_requirement(requires: list[str] | None) -> str | None:
    """The specifier a distribution's ``Requires-Dist`` lines put on hicache-core (``""``: any version)."""
    for line in requires or ():
        match = _REQUIREMENT.match(line)
        if match and not (match.group(2) and "extra" in match.group(2)):
            return match.group(1).strip()
    return None


def _release(text: str) -> tuple[int, ...]:
    match = re.match(r"^\s*([0-9]+(?:\.[0-9]+)*)", text)
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def _pad(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)), b + (0,) * (n - len(b))


def admits(specifier: str, version: str) -> bool | None:
    """Whether ``version`` satisfies ``specifier`` (``None``: a specifier this module does not read)."""
    have = _release(version)
    if not have:
        return None
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        match = _CLAUSE.match(clause)
        if match is None:
            return None
        op, number, star = match.group(1), _release(match.group(2)), bool(match.group(3))
        if star:
            if op not in ("==", "!="):
                return None
            same = have[: len(number)] == number
            ok = same if op == "==" else not same
        elif op == "~=":
            if len(number) < 2:
                return None
            a, b = _pad(have, number)
            ok = a >= b and have[: len(number) - 1] == number[:-1]
        else:
            a, b = _pad(have, number)
            ok = {"==": a == b, "!=": a != b, "<=": a <= b, ">=": a >= b, "<": a < b, ">": a > b}[op]
        if not ok:
            return False
    return True


def compatibility_problem(requirement: str | None, version: str) -> str | None:
    """Why a plugin that requires ``requirement`` cannot be trusted on hicache-core ``version`` (``None``: it can)."""
    if requirement is None or requirement == "":
        return None
    verdict = admits(requirement, version)
    if verdict is None:
        return f"requires hicache-core {requirement}, which hicache cannot check; running {version}"
    if not verdict:
        return (
            f"requires hicache-core {requirement}, but {version} is running: it was written for another plugin API "
            "(docs/plugins.md, \"Versions\"); install a release of the plugin made for this one"
        )
    return None
