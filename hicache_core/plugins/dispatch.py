"""The dispatcher: one place that picks an implementation, and one readable error.

:func:`resolve` walks the implementations of an io backend in priority order and
returns the first that gives no reason to refuse. When none claims the request it
raises :class:`UnsupportedCombinationError`, whose message says, in this order:
the request; each implementation and its reasons; what would work instead;
plugins that failed to load; install hints for first-party plugins.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from .implementation import Implementation, TransferRequest
from .plugin_sources import source_tree_plugins
from .registry import ENV_PLUGINS, Registry


class UnsupportedCombinationError(ValueError):
    """No installed implementation claims a requested combination.

    Raised by :func:`hicache_core.make_host_pool`, before any memory is touched.
    The request is available as attributes (``io_backend``, ``pool_kind``,
    ``layout``, ``operation``, ``device_type``, ``sharded``, ``draft``,
    ``item_bytes``; ``request`` is the full :class:`TransferRequest` when the
    layout is known), and ``reasons`` maps each implementation name to its reasons.
    """

    def __init__(
        self,
        message: str,
        *,
        request: TransferRequest | None = None,
        io_backend: str | None = None,
        layout: str | None = None,
        operation: str | None = None,
        reasons: dict[str, list[str]] | None = None,
        forced: str | None = None,
    ) -> None:
        super().__init__(message)
        self.request = request
        self.io_backend = request.io_backend if request else io_backend
        self.layout = request.layout.name if request else layout
        self.operation = request.operation if request else operation
        self.pool_kind = request.pool_kind if request else None
        self.device_type = request.device_type if request else None
        self.sharded = request.sharded if request else None
        self.draft = request.draft if request else None
        self.item_bytes = request.geometry.item_bytes if request else None
        self.reasons = reasons or {}
        self.forced = forced


def reasons_for(impl: type[Implementation], request: TransferRequest, registry: Registry | None = None) -> list[str]:
    """An implementation's reasons, plus the one it cannot give itself: whether the layout can store the pool.

    An exception from ``not_supported_reasons`` becomes a reason; with ``registry`` given it is
    also warned about, naming the plugin, since another implementation may win silently.
    """
    reasons = []
    problem = request.layout_problem
    if problem is not None:
        reasons.append(f"layout {request.layout.name!r} cannot store this {request.pool_kind} pool: {problem}")
    try:
        reasons += impl.not_supported_reasons(request)
    except Exception as exc:  # noqa: BLE001 - a plugin bug must not hide behind a traceback in dispatch
        reasons.append(f"not_supported_reasons raised {type(exc).__name__}: {exc}")
        if registry is not None:
            warnings.warn(
                f"hicache: {impl.name} (plugin {registry.plugin_of(impl.name)}) raised in not_supported_reasons "
                f"and is treated as refusing: {type(exc).__name__}: {exc}",
                stacklevel=3,
            )
    return list(dict.fromkeys(reasons))


def claims(registry: Registry, request: TransferRequest) -> type[Implementation] | None:
    """The best implementation claiming ``request``, or ``None``."""
    winners = [impl for impl in registry.candidates(request.io_backend) if not reasons_for(impl, request, registry)]
    if not winners:
        return None
    best = winners[0]
    tied = [w for w in winners[1:] if w.priority == best.priority]
    if tied:
        names = ", ".join(f"{w.name} (plugin {registry.plugin_of(w.name)})" for w in tied)
        warnings.warn(
            f"hicache: {best.name} (plugin {registry.plugin_of(best.name)}) and {names} claim the same request at "
            f"priority {best.priority}; {best.name} is chosen by name. Give them different priorities.",
            stacklevel=3,
        )
    return best


#: Per registry, its generation and what each (request, force) resolved to (or the error it raised).
_resolved: weakref.WeakKeyDictionary[Registry, tuple[int, dict[Any, Any]]] = weakref.WeakKeyDictionary()


def resolve(registry: Registry, request: TransferRequest, *, force: str | None = None) -> type[Implementation]:
    """The implementation for ``request``, or :class:`UnsupportedCombinationError` saying why not."""
    key = (request, force)
    generation, table = _resolved.get(registry, (None, None))
    if generation != registry.generation or table is None:
        table = {}
        _resolved[registry] = (registry.generation, table)
    cached = table.get(key)
    if cached is None:
        cached = _resolve(registry, request, force)
        table[key] = cached
    if isinstance(cached, UnsupportedCombinationError):
        raise cached
    return cached


def _resolve(registry: Registry, request: TransferRequest, force: str | None):
    if force is not None:
        impl = registry.implementations.get(force)
        if impl is None:
            known = ", ".join(sorted(registry.implementations)) or "none"
            return UnsupportedCombinationError(
                f"Unknown implementation {force!r} was forced; installed implementations: {known}",
                request=request,
                forced=force,
            )
        reasons = reasons_for(impl, request)
        if request.io_backend not in ("auto", impl.io_backend):
            reasons.insert(0, f"it serves io backend {impl.io_backend!r}, not {request.io_backend!r}")
        if reasons:
            return UnsupportedCombinationError(
                explain_refusal(registry, request, {impl.name: reasons}, forced=force),
                request=request,
                reasons={impl.name: reasons},
                forced=force,
            )
        return impl
    best = claims(registry, request)
    if best is not None:
        return best
    reasons = {impl.name: reasons_for(impl, request) for impl in registry.candidates(request.io_backend)}
    return UnsupportedCombinationError(explain_refusal(registry, request, reasons), request=request, reasons=reasons)


def alternatives(registry: Registry, request: TransferRequest) -> tuple[list[str], list[str]]:
    """(io backends that would serve this layout, layouts this io backend would serve), asked of the registry."""
    backends = [
        b
        for b in registry.io_backends()
        if b not in (request.io_backend, "reference") and claims_quietly(registry, request.with_(io_backend=b))
    ]
    layouts = [
        name
        for name, layout in sorted(registry.layouts.items())
        if name != request.layout.name
        and request.io_backend not in (None, "")
        and claims_quietly(registry, request.with_(layout=layout))
    ]
    return backends, layouts


def claims_quietly(registry: Registry, request: TransferRequest) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return claims(registry, request) is not None
        except ValueError:  # a layout that cannot be derived for this pool (e.g. a split it lacks)
            return False


def install_hints(registry: Registry, io_backend: str | None) -> list[str]:
    """How to get the plugins that serve ``io_backend``: from plugin metadata, never from a list kept here.

    Installed plugins that ``HICACHE_PLUGINS`` leaves out are named from their entry points (all of
    them, unless the source tree's metadata says they serve another io backend). Plugins that are not
    installed are found where hicache's first-party plugins live, in its source tree
    (``plugins/*/pyproject.toml``, ``[tool.hicache] io-backends``), and named with the command that
    installs them from there: they are on no package index.
    """
    wanted = None if io_backend == "auto" else io_backend
    known = {p.distribution: p for p in source_tree_plugins()}
    hints = []
    for record in registry.plugins.values():
        if record.status != "filtered":
            continue
        meta = known.get(record.distribution or "")
        if wanted is None or meta is None or wanted in meta.io_backends:
            hints.append(
                f"{record.distribution or record.name} is installed but {ENV_PLUGINS} leaves it out; "
                f"add {record.name!r} to it"
            )
    installed = {r.distribution for r in registry.plugins.values() if r.distribution}
    for plugin in known.values():
        if plugin.distribution in installed or not plugin.io_backends:
            continue
        if wanted is not None and wanted not in plugin.io_backends:
            continue
        serves = ", ".join(repr(b) for b in plugin.io_backends)
        hints.append(plugin.install_hint(f"(io backend {serves})"))
    return hints


def explain_refusal(
    registry: Registry,
    request: TransferRequest,
    reasons: dict[str, list[str]],
    *,
    forced: str | None = None,
) -> str:
    """The full, readable refusal message."""
    backend = request.io_backend
    if forced:
        head = f"The forced implementation {forced!r} cannot run {request.operation} with:"
    else:
        head = f"No implementation of io backend {backend!r} can run {request.operation} with:"
    lines = [head]
    lines += [f"    {label:<12} {value}" for label, value in request.describe()]
    if reasons:
        lines.append("Implementations and why each refused:")
        for name, why in reasons.items():
            impl = registry.implementations[name]
            lines.append(f"    {name} (plugin {registry.plugin_of(name)}, priority {impl.priority}):")
            lines += [f"        - {r}" for r in why]
    else:
        installed = ", ".join(b for b in registry.io_backends()) or "none"
        lines.append(f"No installed plugin serves io backend {backend!r}. Valid io backends: auto, {installed}.")
    backends, layouts = alternatives(registry, request)
    lines.append("What would work instead:")
    lines.append(
        f"    io backends for layout {request.layout.name!r}: "
        + (", ".join(repr(b) for b in backends) or "none installed")
    )
    if backend not in (None, ""):
        lines.append(
            f"    layouts for io backend {backend!r}: "
            + (", ".join(repr(name) for name in layouts) or "none installed")
        )
    lines += failed_plugin_lines(registry)
    lines += install_hints(registry, backend)
    return "\n".join(lines)


def failed_plugin_lines(registry: Registry) -> list[str]:
    """Every plugin that failed to load or register (refused at load included), with why; none: no lines."""
    failed = registry.failed_plugins()
    lines = ["Plugins that failed to load or register:"] if failed else []
    for record in failed:
        lines += [f"    {record.name} ({record.distribution or 'no distribution'}): {err}" for err in record.errors]
    return lines
