"""The core's own plugin: built-in pool kinds, layouts, the reference implementation and ``memory://``.

It registers through the same hooks as every installed plugin (as llm's default plugins do), and
lives apart from the registry so that the registry need not reach down to what it registers.
"""

from __future__ import annotations

from ..declared.layouts import BUILTIN_LAYOUTS
from ..declared.pool_kinds import BUILTIN_POOL_KINDS
from ..storage.memory import MemoryStorage
from . import hookspecs
from .reference import ReferenceImplementation


class CorePlugin:
    """The core registers its built-in pool kinds and layouts through the same hooks as everyone else."""

    @hookspecs.hookimpl
    def hicache_register_pool_kinds(self, register):
        for kind in BUILTIN_POOL_KINDS:
            register(kind)

    @hookspecs.hookimpl
    def hicache_register_layouts(self, register):
        for layout in BUILTIN_LAYOUTS:
            register(layout)

    @hookspecs.hookimpl
    def hicache_register_backends(self, register):
        register(ReferenceImplementation)

    @hookspecs.hookimpl
    def hicache_register_storage_backends(self, register):
        register(MemoryStorage)
