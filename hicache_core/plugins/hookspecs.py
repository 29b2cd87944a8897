"""The hook specifications: the whole contract between hicache and its plugins.

Plugins are found through the ``hicache`` entry point group and implement these
hooks with ``from hicache_core import hookimpl``. Each hook hands the plugin a
``register`` callback; plugins never return lists and never dispatch: the core
owns selection (see :mod:`hicache_core.plugins.dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ..declared.layouts import Layout
    from ..declared.pool_kinds import PoolKind
    from ..storage.backend import StorageBackend
    from .implementation import Implementation

PROJECT = "hicache"
hookspec = pluggy.HookspecMarker(PROJECT)
#: The marker plugins decorate their hook implementations with.
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def hicache_register_backends(register: Callable[[type[Implementation]], None]) -> None:
    """Register the transfer implementations this plugin provides.

    Called once per process, when hicache first needs its registry (the first
    :func:`hicache_core.make_host_pool`, ``hicache plugins``, ...), after every
    plugin's :func:`hicache_register_layouts`, so implementations may refer to
    layouts other plugins declare.

    :param register: call ``register(ImplementationClass)`` for each subclass of
        :class:`hicache_core.Implementation`. The class is checked on the spot;
        a malformed one is recorded against this plugin (``hicache plugins``
        shows it) and skipped, and the plugin's other registrations stand.

    Return nothing. Do not compile kernels or initialise CUDA here: registration
    must stay cheap. An exception raised here marks the plugin as failed with
    that error; it never takes other plugins down.
    """


@hookspec
def hicache_register_layouts(register: Callable[[Layout], None]) -> None:
    """Register host layouts this plugin declares.

    Called once per process, before :func:`hicache_register_backends`.

    :param register: call ``register(Layout(...))`` for each new
        :class:`hicache_core.Layout`. Host pools can then allocate it by name with
        no change to the core, and every implementation that computes addresses
        from layout declarations can serve it. A name that is already registered
        is refused and recorded against this plugin.

    Return nothing. An exception marks the plugin as failed with that error.
    """


@hookspec
def hicache_register_pool_kinds(register: Callable[[PoolKind], None]) -> None:
    """Register pool kinds this plugin declares.

    Called once per process, before :func:`hicache_register_layouts` and
    :func:`hicache_register_backends`, so layouts and implementations may refer to
    the kinds every plugin declares.

    :param register: call ``register(PoolKind(...))`` for each new
        :class:`hicache_core.PoolKind`: its components with their device and host
        attribute names, token or page items, how to recognise such a device pool.
        Host pools of that kind can then be made with every layout that can be
        derived for it, and every implementation that computes addresses from the
        declarations serves it, with no change to the core. A name that is already
        registered is refused and recorded against this plugin.

    Return nothing. An exception marks the plugin as failed with that error.
    """


@hookspec
def hicache_register_storage_backends(register: Callable[[type[StorageBackend]], None]) -> None:
    """Register the L3 storage backends this plugin provides, one per URL scheme.

    Called once per process, when hicache first needs its registry, after every
    plugin's :func:`hicache_register_backends`. :func:`hicache_core.storage.make_storage`
    then builds a backend for any URL whose scheme one of them registered.

    :param register: call ``register(BackendClass)`` for each subclass of
        :class:`hicache_core.storage.StorageBackend`; its ``scheme`` class attribute
        (``"file"``, ``"redis"``, ...) is the URL scheme it serves. A class that is not
        such a subclass, has no scheme, or takes a scheme already registered is refused
        and recorded against this plugin; its other registrations stand.

    Return nothing. Do not connect to a store or import a heavy client library here:
    registration must stay cheap, and a missing client is an error when a URL of that
    scheme is opened, not at startup. An exception raised here marks the plugin as
    failed with that error; it never takes other plugins down.
    """
