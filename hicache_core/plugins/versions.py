"""hicache-core's version, and whether a plugin's required range admits it (docs/plugins.md, "Versions").

A plugin pins the range of hicache-core it was written for in its distribution's dependencies
(``hicache-core>=0.4,<0.5``). Installs that skip dependency resolution (``--no-deps``, editable
trees) can still put a plugin beside a core outside that range, so the registry checks it before
it imports the plugin, and ``hicache plugins`` shows it. The plugin API is a version's first two
numbers; a minor version removes only what the one before deprecated, so a plugin written for the
previous API (its range admits 0.3, the core is 0.4) still loads. One written for an older API, or
for a newer one, is refused at load, with what changed since the API it was written for
(:data:`API_CHANGES`). The specifiers read are PEP 440's comparison operators over release
numbers; anything else is reported as not checked, never guessed.
"""

from __future__ import annotations

import re
from importlib import metadata

#: This tree's version (the distribution's metadata wins where it is installed).
CORE_VERSION = "0.4.0"
CORE_DISTRIBUTION = "hicache-core"

#: What each plugin API changed that a plugin written for an earlier one must act on (docs/plugins.md, "Versions").
API_CHANGES: dict[str, tuple[str, ...]] = {
    "0.2": (
        "the conformance kit fails an implementation whose layout declares no oracle",
        "a host pool smaller than its device pool is refused",
    ),
    "0.3": (
        "the storage page API moved off StorageBackend to PageStore, which make_storage returns: a storage "
        "plugin implements exists_objects, put_objects and get_objects_into (or get_objects) only",
    ),
    "0.4": (
        "0.2's page API on a storage backend (page methods, bind, host_pool) and the backend's members read "
        "through make_storage's result (store.client: use store.backend.client) are gone",
        "Layout.split_at and Layout(split_at=...) are gone (split=True), and a layout that stores any pool kind "
        "has pool_kinds None (layout.allows(kind))",
        "the old paths hicache_core.storage.url.make_storage, hicache_core.pool.geometry's host-layout names and "
        "hicache_core.storage.backend's STORAGE_BATCH_SIZE, StorageStats, check_keys and parallel_checksums are gone",
    ),
}
#: Every plugin API hicache-core has had, oldest first.
APIS: tuple[str, ...] = ("0.1", *API_CHANGES)

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


def api_of(version: str) -> str:
    """The plugin API of ``version``: its first two numbers (``"0.4"`` for 0.4.2)."""
    return ".".join(str(n) for n in (_release(version) + (0, 0))[:2])


def written_for(specifier: str) -> str | None:
    """The newest plugin API of :data:`APIS` that ``specifier`` admits a release of (``None``: none of them)."""
    literal = [m.group(2) for m in map(_CLAUSE.match, specifier.split(",")) if m]
    for api in reversed(APIS):
        probes = [f"{api}.{patch}" for patch in range(100)] + [v for v in literal if api_of(v) == api]
        if any(admits(specifier, probe) for probe in probes):
            return api
    return None


def _served(requirement: str, version: str) -> str | None:
    """The API a plugin was written for, where this core still serves it: the previous one, one minor version on."""
    api, current = written_for(requirement), api_of(version)
    older = [a for a in APIS if _release(a) < _release(current)]
    return api if api is not None and older and api == older[-1] else None


def refuses(requirement: str | None, version: str) -> bool:
    """Whether a plugin that requires ``requirement`` is refused at load beside hicache-core ``version``."""
    if not requirement or admits(requirement, version) is not False:
        return False
    return _served(requirement, version) is None


def served_note(requirement: str | None, version: str) -> str | None:
    """What ``hicache plugins`` says of a plugin whose range excludes ``version`` but whose API is still served."""
    if not requirement or admits(requirement, version) is not False:
        return None
    api = _served(requirement, version)
    if api is None:
        return None
    return f"written for plugin API {api}, which {api_of(version)} still serves (it removed only what {api} deprecated)"


def compatibility_problem(requirement: str | None, version: str) -> str | None:
    """Why a plugin that requires ``requirement`` cannot be trusted on hicache-core ``version`` (``None``: it can).

    For a plugin :func:`refuses`, the message that refuses it: the plugin API it was written for and
    what changed since (:data:`API_CHANGES`).
    """
    if requirement is None or requirement == "":
        return None
    verdict = admits(requirement, version)
    if verdict is None:
        return f"requires hicache-core {requirement}, which hicache cannot check; running {version}"
    if verdict or _served(requirement, version) is not None:
        return None
    head = f"requires hicache-core {requirement}, but {version} is running: refused at load, nothing of it is used"
    api, current = written_for(requirement), api_of(version)
    if api is None or _release(api) >= _release(current):
        return (f"{head}. It was written for a hicache-core other than this one (a newer one, or one that is not "
                f"{version}): install a hicache-core it admits, or a release of the plugin made for plugin API "
                f"{current} (docs/plugins.md, \"Versions\")")  # fmt: skip
    changes = [f"{later}: " + "; ".join(API_CHANGES[later]) for later in APIS if _release(api) < _release(later)
               and _release(later) <= _release(current)]  # fmt: skip
    tail = f'Install a release of the plugin made for plugin API {current} (docs/plugins.md, "Versions")'
    return f"{head}. It was written for plugin API {api}; changed since: " + " | ".join(changes) + f". {tail}"
