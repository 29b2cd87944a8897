"""Lazy public faces: a package's names imported on first use, and moved names kept for a while.

A face (``hicache_core``, ``hicache_core.storage``, ``hicache_core.testing``, a plugin's package)
maps each public name to the submodule that defines it, so that importing the face, or one of
its light submodules (the hook markers, the kit's pytest plugin), does not import torch::

    __getattr__, __dir__ = lazy_face(globals(), {"make_host_pool": "host_pool"})

A name is imported once and then kept in the face's namespace, so later reads are plain
attribute reads. A name that moved (:class:`Moved`) still resolves, with a ``DeprecationWarning``
naming its new path, on every read until it goes. Anything else raises Python's own
``AttributeError`` (``module 'x' has no attribute 'y'``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Moved:
    """A public name that moved: where it lives now, and the versions of the move and of its removal.

    ``module`` is the module to import it from; ``public`` the path the warning names (a face, where
    the name is exported, or the module itself).
    """

    module: str
    public: str
    since: str = "0.2.0"
    until: str = "0.3.0"

    def warning(self, old: str, name: str) -> str:
        return (f"{old}.{name} moved to {self.public}.{name} (hicache-core {self.since}); "
                f"the old path goes in {self.until}")  # fmt: skip

    def warn(self, old: str, name: str, stacklevel: int = 3) -> None:
        """Issue :meth:`warning` as a ``DeprecationWarning`` for the caller ``stacklevel - 1`` frames up."""
        warnings.warn(self.warning(old, name), DeprecationWarning, stacklevel=stacklevel)


def lazy_face(
    namespace: dict[str, Any],
    exports: Mapping[str, str],
    *,
    moved: Mapping[str, Moved] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the module whose ``globals()`` is ``namespace``.

    ``exports`` maps a public name to its submodule, relative to that module's package
    (``"pool.host_pool"`` in ``hicache_core``: ``hicache_core.pool.host_pool``); ``moved`` maps a name that
    moved to its :class:`Moved` record. ``__dir__`` lists the namespace and every export, not the
    moved names.
    """
    module_name = namespace["__name__"]
    package = namespace.get("__package__") or module_name.rpartition(".")[0]
    moved = dict(moved or {})

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is not None:
            value = getattr(importlib.import_module(f".{source}", package), name)
            namespace[name] = value  # later reads find it without this function
            return value
        record = moved.get(name)
        if record is not None:
            warnings.warn(record.warning(module_name, name), DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(record.module), name)
        if f"{module_name}.{name}" in MOVED_MODULES:  # a submodule that moved into a room (it warns)
            return importlib.import_module(f"{module_name}.{name}")
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}", name=name,
                             obj=sys.modules.get(module_name))  # fmt: skip

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


#: Modules that moved into the core's rooms in hicache-core 0.4.0 (``hicache_core/pool/``, ``loads/``,
#: ``verification/``, ``declared/``, ``plugins/``, ``settings/``): the old path imports the same module object,
#: with a ``DeprecationWarning`` naming the new one, until 0.6.0 (``docs/plugin-versions.md``).
MOVED_MODULES: dict[str, str] = {
    "hicache_core.allocator": "hicache_core.pool.allocator",
    "hicache_core.autoselect": "hicache_core.plugins.autoselect",
    "hicache_core.builtin": "hicache_core.plugins.builtin",
    "hicache_core.check_batch": "hicache_core.verification.check_batch",
    "hicache_core.device_pools": "hicache_core.pool.device_pools",
    "hicache_core.dispatch": "hicache_core.plugins.dispatch",
    "hicache_core.drops": "hicache_core.pool.drops",
    "hicache_core.geometry": "hicache_core.pool.geometry",
    "hicache_core.hookspecs": "hicache_core.plugins.hookspecs",
    "hicache_core.host_layout": "hicache_core.pool.host_layout",
    "hicache_core.host_pool": "hicache_core.pool.host_pool",
    "hicache_core.implementation": "hicache_core.plugins.implementation",
    "hicache_core.indices": "hicache_core.pool.indices",
    "hicache_core.layer_loads": "hicache_core.loads.layer_loads",
    "hicache_core.layer_map": "hicache_core.pool.layer_map",
    "hicache_core.layout_oracles": "hicache_core.declared.layout_oracles",
    "hicache_core.layouts": "hicache_core.declared.layouts",
    "hicache_core.page_access": "hicache_core.pool.page_access",
    "hicache_core.page_checksum": "hicache_core.verification.page_checksum",
    "hicache_core.plan": "hicache_core.pool.plan",
    "hicache_core.plugin_sources": "hicache_core.plugins.plugin_sources",
    "hicache_core.pool_events": "hicache_core.pool.pool_events",
    "hicache_core.pool_kinds": "hicache_core.declared.pool_kinds",
    "hicache_core.pool_loads": "hicache_core.loads.pool_loads",
    "hicache_core.reference": "hicache_core.plugins.reference",
    "hicache_core.registry": "hicache_core.plugins.registry",
    "hicache_core.settings_registry": "hicache_core.settings.registry",
    "hicache_core.slot_events": "hicache_core.pool.slot_events",
    "hicache_core.transfer_errors": "hicache_core.pool.transfer_errors",
    "hicache_core.validation": "hicache_core.pool.validation",
    "hicache_core.variables": "hicache_core.settings.variables",
    "hicache_core.verify": "hicache_core.verification.verify",
    "hicache_core.versions": "hicache_core.plugins.versions",
}
MODULES_MOVED_IN, MODULES_GO_IN = "0.4.0", "0.6.0"


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module's old path as the module at its new one (one object under two names)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        new = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} moved to {new} (hicache-core {MODULES_MOVED_IN}); the old path goes in "
                      f"{MODULES_GO_IN}", DeprecationWarning, stacklevel=2)  # fmt: skip
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the module ran under its new name."""


def install_moved_modules() -> None:
    """Let the old paths of :data:`MOVED_MODULES` import (once per process)."""
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())  # before any finder that might hold a stale copy
