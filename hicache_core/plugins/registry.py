"""Plugin discovery and the registry of layouts and implementations.

Plugins come from the ``hicache`` entry point group, loaded lazily, once per
process, filtered by ``HICACHE_PLUGINS`` (unset: all; empty: none; ``a,b``: only
the entry points or distributions named). A plugin that fails to import, raises
in a hook or registers something malformed is recorded with its error, shown by
``hicache plugins`` and in every dispatch error; it never takes others down.
"""

from __future__ import annotations

import os
import threading
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from ..declared.layouts import Layout, layout_problems
from ..declared.pool_kinds import PoolKind, pool_kind_problems
from ..pool.geometry import example_geometry
from ..settings.variables import PLUGINS
from ..storage.backend import StorageBackend
from . import hookspecs
from .builtin import CorePlugin
from .implementation import OPERATIONS, Implementation, TransferRequest
from .versions import compatibility_problem, core_requirement, core_version, refuses

ENV_PLUGINS = PLUGINS.name
ENTRY_POINT_GROUP = "hicache"
CORE_PLUGIN = "hicache_core"


@dataclass
class PluginRecord:
    """What ``hicache plugins`` shows for one plugin."""

    name: str
    distribution: str | None = None
    version: str | None = None
    status: str = "loaded"  # loaded | failed | filtered | missing (named in HICACHE_PLUGINS, not installed)
    errors: list[str] = field(default_factory=list)
    implementations: list[str] = field(default_factory=list)
    layouts: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    pool_kinds: list[str] = field(default_factory=list)
    storage_backends: list[str] = field(default_factory=list)
    #: The range of hicache-core its distribution requires (``None``: not declared; ``""``: any).
    requires: str | None = None
    #: Refused at load (a hook or a declaration raised): nothing it registered is used.
    refused: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "errors": list(self.errors),
            "hooks": list(self.hooks),
            "pool_kinds": list(self.pool_kinds),
            "layouts": list(self.layouts),
            "implementations": list(self.implementations),
            "storage_backends": list(self.storage_backends),
            "requires": self.requires,
            "compatible": compatibility_problem(self.requires, core_version()) is None,
        }


def allowed_plugins(value: str | None = None) -> set[str] | None:
    """Parse ``HICACHE_PLUGINS`` (or ``value``, its text): ``None`` allows all, an empty set none."""
    names = PLUGINS.read() if value is None else PLUGINS.parse_text(value)
    return None if names is None else set(names)


class Registry:
    """Layouts, implementations and plugin records; one per process by default."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.pool_kinds: dict[str, PoolKind] = {}
        self.layouts: dict[str, Layout] = {}
        self.implementations: dict[str, type[Implementation]] = {}
        self.storage_backends: dict[str, type] = {}  # URL scheme -> StorageBackend subclass
        self.owner: dict[tuple[str, str], str] = {}  # (what, name) -> plugin name; what as in plugin_of
        self.plugins: dict[str, PluginRecord] = {}
        self.allow: set[str] | None = None
        #: Bumped whenever registrations change; caches of answers about this registry (dispatch's) key on it.
        self.generation = 0
        self._sorted: dict[str, list[type[Implementation]]] = {}
        self._probe_key: tuple | None = None
        self._probe_list: list[TransferRequest] = []
        self.add_plugin(CorePlugin(), CORE_PLUGIN, distribution="hicache-core", version=_version("hicache-core"))

    @classmethod
    def from_entry_points(cls, allow: set[str] | None = None) -> Registry:
        registry = cls()
        registry.load_entry_points(allow)
        return registry

    def load_entry_points(self, allow: set[str] | None = None) -> None:
        self.allow = allow
        seen = {CORE_PLUGIN, "hicache-core"}
        loaded = []
        for ep in sorted(_entry_points(), key=lambda e: e.name):
            dist = getattr(getattr(ep, "dist", None), "name", None)
            version = getattr(getattr(ep, "dist", None), "version", None)
            requires = core_requirement(getattr(getattr(ep, "dist", None), "requires", None))
            seen.update((ep.name, dist))
            if allow is not None and ep.name not in allow and dist not in allow:
                self.plugins[ep.name] = PluginRecord(ep.name, dist, version, status="filtered")
                continue
            problem = compatibility_problem(requires, core_version())
            if refuses(requires, core_version()):  # before its import: code written for another API may not import
                key = self._record_key(ep.name, dist)
                refused = PluginRecord(key, dist, version, "failed", [problem or ""], requires=requires, refused=True)
                self.plugins[key] = refused
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's, and is reported
                key = self._record_key(ep.name, dist)
                self.plugins[key] = PluginRecord(key, dist, version, "failed", [_error_text(exc)], requires=requires)
                continue
            record = self.add_plugin(plugin, ep.name, distribution=dist, version=version, run_hooks=False)
            record.requires = requires
            if problem is not None:
                record.errors.append(problem)
            if record.status != "failed":
                loaded.append((plugin, record))
        # Phases, as the hook specs promise: every plugin's pool kinds, then layouts, then backends.
        for plugin, record in loaded:
            self._call(plugin, record, "hicache_register_pool_kinds", self._pool_kind_registrar(record))
        for plugin, record in loaded:
            self._call(plugin, record, "hicache_register_layouts", self._layout_registrar(record))
        self._bind_declarations()
        for plugin, record in loaded:
            self._call(plugin, record, "hicache_register_backends", self._backend_registrar(record))
        for plugin, record in loaded:
            self._call(plugin, record, "hicache_register_storage_backends", self._storage_registrar(record))
        for _plugin, record in loaded:
            self._probe_declarations(record)
        self.generation += 1
        self._sorted.clear()
        for name in sorted((allow or set()) - seen):  # a typo in HICACHE_PLUGINS must not pass silently
            self.plugins[name] = PluginRecord(
                name,
                status="missing",
                errors=[f"{ENV_PLUGINS} names {name!r}, but no installed plugin has that entry point or distribution"],
            )

    def add_plugin(
        self,
        plugin: object,
        name: str,
        *,
        distribution: str | None = None,
        version: str | None = None,
        run_hooks: bool = True,
    ) -> PluginRecord:
        """Register one plugin object and (unless ``run_hooks`` is false) run its registration hooks, kinds first."""
        key = self._record_key(name, distribution)
        record = PluginRecord(key, distribution, version)
        if key != name:  # two plugins chose one entry point name: keep both, and say so
            other = self.plugins[name].distribution or "another plugin"
            record.errors.append(f"entry point name {name!r} is also used by {other}; loaded as {key!r}")
        self.plugins[key] = record
        try:
            self.pm.register(plugin, name=key)
        except Exception as exc:  # noqa: BLE001 - pluggy validation errors name the bad hook
            record.status, record.errors = "failed", [*record.errors, _error_text(exc)]
            return record
        callers = self.pm.get_hookcallers(plugin) or []
        record.hooks = sorted(h.name for h in callers)
        known = sorted(n for n in dir(hookspecs) if n.startswith(f"{hookspecs.PROJECT}_"))
        unknown = [h.name for h in callers if h.spec is None]
        if unknown:
            record.errors.append(f"implements {', '.join(unknown)}, not a hicache hook (hooks: {', '.join(known)})")
        if len(unknown) == len(callers):
            unmarked = [n for n in known if callable(getattr(plugin, n, None))]
            hint = f" ({', '.join(unmarked)} defined but not marked)" if unmarked else ""
            record.status = "failed"
            record.errors.append(f"implements no hicache hook{hint}: mark hook functions with @hicache_core.hookimpl")
        if run_hooks:
            self._call(plugin, record, "hicache_register_pool_kinds", self._pool_kind_registrar(record))
            self._call(plugin, record, "hicache_register_layouts", self._layout_registrar(record))
            self._bind_declarations()
            self._call(plugin, record, "hicache_register_backends", self._backend_registrar(record))
            self._call(plugin, record, "hicache_register_storage_backends", self._storage_registrar(record))
            self._probe_declarations(record)
            self.generation += 1
            self._sorted.clear()
        return record

    def _bind_declarations(self) -> None:
        """Resolve names between declarations once, here: a kind's ``shape_as`` -> this registry's layouts."""
        for name, kind in list(self.pool_kinds.items()):
            bound, missing = kind.resolved(self.layouts)
            self.pool_kinds[name] = bound
            record = self.plugins.get(self.owner.get(("pool kind", name), ""))
            for other in missing:
                error = f"pool kind {name!r} presents a layout with layout {other!r}'s shape, which no plugin registers"
                if record is not None and error not in record.errors:
                    record.errors.append(error)

    def _record_key(self, name: str, distribution: str | None) -> str:
        """``name``, or ``name@distribution`` when another plugin already holds that name."""
        key, n = name, 1
        while key in self.plugins:
            n += 1
            key = f"{name}@{distribution or 'unknown'}" + (f"#{n}" if n > 2 else "")
        return key

    def _call(self, plugin, record, hook_name, register) -> None:
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            if impl.plugin is not plugin or record.refused:
                continue
            try:
                impl.function(register=register)
            except Exception as exc:  # noqa: BLE001 - reported against the plugin, others go on
                self._refuse(record, f"{hook_name} raised {_error_text(exc)}")

    def _refuse(self, record: PluginRecord, why: str) -> None:
        """Refuse a plugin at load: its error is listed, and nothing it registered stays (no fault inside dispatch)."""
        withdrawn = []
        for what, table, names in (
            ("pool kind", self.pool_kinds, record.pool_kinds),
            ("layout", self.layouts, record.layouts),
            ("implementation", self.implementations, record.implementations),
            ("storage backend", self.storage_backends, record.storage_backends),
        ):
            for name in names:
                table.pop(name, None)
                self.owner.pop((what, name), None)
                withdrawn.append(f"{what} {name}")
            names.clear()
        record.status, record.refused = "failed", True
        record.errors.append(why + (f"; refused at load, withdrawn: {', '.join(withdrawn)}" if withdrawn else ""))
        self._sorted.clear()

    def _probe_declarations(self, record: PluginRecord) -> None:
        """Ask each of the plugin's implementations about every kind, layout, operation and device, once, now.

        An implementation whose ``not_supported_reasons`` raises would otherwise surface inside dispatch,
        on a server's call path; here it refuses its plugin at load instead, with the request that broke it.
        """
        for name in list(record.implementations):
            impl = self.implementations[name]
            for request in self._probes():
                try:
                    impl.not_supported_reasons(request.with_(io_backend=impl.io_backend))
                except Exception as exc:  # noqa: BLE001 - the plugin's bug, reported against it
                    where = f"{request.pool_kind}, {request.layout.name}, {request.operation}, {request.device_type}"
                    self._refuse(record, f"implementation {name}: not_supported_reasons raised {_error_text(exc)} "
                                         f"for ({where})")  # fmt: skip
                    return

    def _probes(self) -> list[TransferRequest]:
        key = (tuple(self.pool_kinds.values()), tuple(self.layouts.values()))
        if self._probe_key != key:
            requests = []
            for kind in self.pool_kinds.values():
                for device in ("cpu", "cuda"):
                    try:
                        geometry = example_geometry(kind, page_size=4, layer_num=2, device_type=device)
                    except Exception:  # noqa: BLE001 - a kind without examples is probed by its users' pools
                        continue
                    for layout in self.layouts.values():
                        for op in OPERATIONS:
                            requests.append(TransferRequest("probe", op, geometry, layout))
            self._probe_key, self._probe_list = key, requests
        return self._probe_list

    def _registrar(
        self,
        record: PluginRecord,
        what: str,
        table: dict[str, Any],
        listed: list[str],
        *,
        accepts: Callable[[Any], bool],
        not_accepted: str,
        problems_of: Callable[[Any], list[str]],
        key_of: Callable[[Any], str],
        label_of: Callable[[Any], str],
        taken: Callable[[str], str],
        before_store: Callable[[Any], None] | None = None,
    ) -> Callable[[Any], None]:
        """The one ``register`` callback: check the type, collect problems, refuse a taken name, store, own."""

        def register(obj: Any) -> None:
            if not accepts(obj):
                if not_accepted:
                    record.errors.append(f"registered {obj!r}, which is not {not_accepted}")
                else:
                    record.errors.append(f"{what} {label_of(obj)} refused: " + "; ".join(problems_of(obj)))
                return
            key = key_of(obj)
            problems = problems_of(obj)
            if key in table:
                problems.append(f"{taken(key)} is already registered by {self.owner[what, key]}")
            if problems:
                record.errors.append(f"{what} {label_of(obj)} refused: " + "; ".join(problems))
                return
            if before_store is not None:
                before_store(obj)
            table[key] = obj
            self.owner[what, key] = record.name
            listed.append(key)

        return register

    def _pool_kind_registrar(self, record: PluginRecord):
        return self._registrar(
            record, "pool kind", self.pool_kinds, record.pool_kinds,
            accepts=lambda kind: isinstance(kind, PoolKind), not_accepted="a hicache_core.PoolKind",
            problems_of=pool_kind_problems, key_of=lambda kind: kind.name, label_of=lambda kind: repr(kind.name),
            taken=lambda name: f"pool kind {name!r}",
        )  # fmt: skip

    def _layout_registrar(self, record: PluginRecord):
        def problems_of(layout: Layout) -> list[str]:
            problems = layout_problems(layout)
            unknown = sorted(set(layout.pool_kinds or ()) - set(self.pool_kinds))
            if unknown:
                problems.append(f"unknown pool kinds {unknown}; registered: {sorted(self.pool_kinds)}")
            return problems

        def warn_twins(layout: Layout) -> None:
            twins = [name for name, other in self.layouts.items() if other.same_arrangement(layout)]
            if twins:
                other = self.plugin_of(twins[0], "layout")
                warnings.warn(
                    f"hicache: layout {layout.name!r} (plugin {record.name}) arranges bytes exactly as layout "
                    f"{twins[0]!r} (plugin {other}) does; both are registered, under two names",
                    stacklevel=3,
                )

        return self._registrar(
            record, "layout", self.layouts, record.layouts,
            accepts=lambda layout: isinstance(layout, Layout), not_accepted="a hicache_core.Layout",
            problems_of=problems_of, key_of=lambda layout: layout.name, label_of=lambda layout: repr(layout.name),
            taken=lambda name: f"layout {name!r}", before_store=warn_twins,
        )  # fmt: skip

    def _backend_registrar(self, record: PluginRecord):
        return self._registrar(
            record, "implementation", self.implementations, record.implementations,
            accepts=lambda impl: isinstance(impl, type) and issubclass(impl, Implementation),
            not_accepted="a subclass of hicache_core.Implementation",
            problems_of=lambda impl: impl.declaration_problems(), key_of=lambda impl: impl.name,
            label_of=lambda impl: impl.__qualname__, taken=lambda name: f"implementation name {name!r}",
        )  # fmt: skip

    def _storage_registrar(self, record: PluginRecord):
        def accepts(backend: Any) -> bool:
            return isinstance(backend, type) and issubclass(backend, StorageBackend)

        return self._registrar(
            record, "storage backend", self.storage_backends, record.storage_backends,
            accepts=accepts, not_accepted="",
            problems_of=lambda b: b.declaration_problems() if accepts(b) else
            [f"{b!r} is not a subclass of hicache_core.storage.StorageBackend"],
            key_of=lambda backend: backend.scheme, label_of=lambda b: repr(getattr(b, "__qualname__", b)),
            taken=lambda scheme: f"scheme {scheme!r}",
        )  # fmt: skip

    def plugin_of_storage(self, scheme: str) -> str:
        return self.owner.get(("storage backend", scheme), "?")

    # ---- queries the dispatcher and the CLI use -------------------------------------------------

    def io_backends(self) -> list[str]:
        return sorted({impl.io_backend for impl in self.implementations.values()})

    def candidates(self, io_backend: str) -> list[type[Implementation]]:
        """Implementations serving ``io_backend`` (``"auto"``: all auto-selectable), best first."""
        found = self._sorted.get(io_backend)
        if found is None:
            found = sorted(
                (
                    impl
                    for impl in self.implementations.values()
                    if impl.io_backend == io_backend or (io_backend == "auto" and impl.auto_selectable)
                ),
                key=lambda impl: (-impl.priority, impl.name),
            )
            self._sorted[io_backend] = found
        return found

    def failed_plugins(self) -> list[PluginRecord]:
        return [r for r in self.plugins.values() if r.errors]

    def plugin_of(self, name: str, what: str = "implementation") -> str:
        """The plugin that registered ``what`` (``"implementation"``, ``"layout"``, ``"pool kind"``,
        ``"storage backend"``) named ``name``, or ``"?"``."""
        return self.owner.get((what, name), "?")


def _entry_points():
    try:
        return metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # Python < 3.10 style API, kept for importlib-metadata backports
        return metadata.entry_points().get(ENTRY_POINT_GROUP, [])


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _error_text(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{at}"


_lock = threading.Lock()
_default: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loading plugins on first use."""
    global _default
    if _default is None:
        with _lock:
            if _default is None:
                _default = Registry.from_entry_points(allowed_plugins())
    return _default


def reset_registry() -> None:
    """Forget the process-wide registry (tests, or after changing ``HICACHE_PLUGINS``)."""
    global _default
    with _lock:
        _default = None
