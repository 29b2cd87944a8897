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
    (``"host_pool"`` in ``hicache_core``: ``hicache_core.host_pool``); ``moved`` maps a name that
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
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}", name=name,
                             obj=sys.modules.get(module_name))  # fmt: skip

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
