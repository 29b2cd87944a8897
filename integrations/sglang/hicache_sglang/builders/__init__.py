"""SGLang 0.5.23's host-pool constructors beyond ``build_kv_host_pool``, taken over by hicache, one module per family.

The families are declared in :mod:`hicache_sglang.families`; each that names a SGLang module
attribute (a host pool class, or a function, SGLang calls as a constructor) names the builder
here that takes the same arguments. :func:`install` replaces it in that module only (other
modules keep SGLang's class for their ``isinstance`` checks) and registers hicache's pool
class as a virtual subclass of SGLang's, so those checks keep their answer.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..families import TAKEOVERS

_patched: list[tuple[Any, str, Any]] = []


def resolve(ref: str) -> Any:
    """``".module:name"`` (relative to this package) -> the object."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module, __name__), name)


def _import_ref(ref: str) -> Any:
    """``"module:name"`` (absolute) -> the object."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def install() -> None:
    """Replace the constructor of every family that names one (:data:`~hicache_sglang.families.TAKEOVERS`), once."""
    if _patched:
        return
    for takeover in TAKEOVERS:
        module = importlib.import_module(takeover.module)
        original = getattr(module, takeover.attr)
        base = _import_ref(takeover.virtual_base) if takeover.virtual_base else original
        if hasattr(base, "register"):  # an ABC: SGLang's isinstance checks elsewhere answer yes
            base.register(resolve(takeover.pool_class))
        setattr(module, takeover.attr, resolve(takeover.builder))
        _patched.append((module, takeover.attr, original))


def uninstall() -> None:
    """Give SGLang its own constructors and builders back."""
    for module, attr, original in reversed(_patched):
        setattr(module, attr, original)
    _patched.clear()
