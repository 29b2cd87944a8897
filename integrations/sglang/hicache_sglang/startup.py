"""Start-up checks and ``--help`` for ``python -m hicache_sglang.launch_server``.

SGLang builds its host pools in the scheduler process, after the model is loaded; a
setting the adapter cannot serve would be refused there, tens of seconds in. These checks
run on SGLang's own resolved server arguments in the launcher, before SGLang starts any
process, so bad input ends the launcher at once with one message. The same checks run again
when the pool is built (for servers started through ``hicache_sglang.install()``).
"""

from __future__ import annotations

import sys
from typing import Any

from hicache_core.settings import Setting, SettingError

from .build import DIRECT_LAYOUTS, check_layout_io
from .errors import NotServedError
from .host_memory import check_host_memory


def settings() -> tuple[Setting, ...]:
    """The settings the adapter and hicache's pools read in a server (``hicache settings`` lists every one)."""
    from hicache_core.settings.variables import LOAD_TIMEOUT, VALIDATE, VERIFY

    from . import variables as v

    return (v.INSTALL, v.HOST_RESERVE_GIB, VALIDATE, VERIFY, v.HISPARSE_SWAP_IN, v.STORAGE_URL, v.METRICS_INTERVAL,
            v.LAYER_LOADS, LOAD_TIMEOUT)  # fmt: skip


def environment() -> dict[str, str]:
    """The environment variables the adapter and hicache read in a server, each with what it does."""
    from hicache_core.plugins.registry import ENV_PLUGINS

    out = {setting.name: setting.doc for setting in settings()}
    out[ENV_PLUGINS] = "comma-separated hicache plugins to load (default: every installed one)"
    # The knobs' own lines: `hicache settings` (every variable, its value and what it takes).
    out["HICACHE_DIRECT_{MAX_BATCH,STREAMS,PREFER_OVERLAP,BATCH}"] = "knobs of the direct io backend's copy engine"
    out["HICACHE_KERNEL_MAX_CTAS, HICACHE_JIT_MAX_CTAS"] = "CTAs of the Triton / JIT kernels (default 8, 0 = every SM)"
    return out


def check(server_args: Any) -> None:
    """Refuse, before SGLang starts, a HiCache setting the adapter cannot serve.

    :raises NotServedError: an io backend no installed hicache plugin serves, a layout SGLang's
        controller cannot drive with the io backend, a ``--hicache-size`` over the host memory budget,
        or ``--enable-hisparse`` without ``HICACHE_SGLANG_HISPARSE_SWAP_IN=sglang``.
    :raises hicache_core.settings.SettingError: a setting holds a value it does not take.
    """
    from sglang.srt.arg_groups.overrides import resolving_view

    for setting in settings():  # a value a setting does not take ends the launcher now, not a scheduler later
        setting.read()
    server_args.resolve_once()  # SGLang's own resolution (it rewrites some layout/io pairs); idempotent
    cfg = resolving_view(server_args)
    if cfg.enable_hisparse:  # HiSparse builds its own host pool, with or without --enable-hierarchical-cache
        from .builders.hisparse import check_swap_in

        check_swap_in("every model")
    if not cfg.enable_hierarchical_cache:
        return
    layout, io_backend = cfg.hicache_mem_layout, cfg.hicache_io_backend
    label = f"host pool (layout {layout!r}, io backend {io_backend!r}, after SGLang's resolution)"
    check_io_backend(io_backend)
    check_layout_io(layout, io_backend, label)
    if cfg.hicache_size and cfg.hicache_size > 0:
        check_host_size(cfg.hicache_size)


def check_io_backend(io_backend: str) -> None:
    """``io_backend`` must be one an installed hicache plugin serves."""
    from hicache_core.plugins.registry import get_registry

    registry = get_registry()
    served = registry.io_backends()
    if io_backend in served:
        return
    failed = "; ".join(f"{r.name}: {' | '.join(r.errors)}" for r in registry.failed_plugins())
    raise NotServedError(
        f"--hicache-io-backend {io_backend!r}: no installed hicache plugin serves io backend {io_backend!r}. "
        f"Installed io backends: {', '.join(served) or 'none'} (hicache plugins)."
        + (f" Plugins that failed to load: {failed}." if failed else "")
        + " Use --hicache-io-backend direct or kernel, or install the plugin that serves it."
    )


def check_host_size(size_gb: float) -> None:
    """``--hicache-size`` GB must fit SGLang's host-memory budget (checked per pool again at build time)."""
    check_host_memory(int(size_gb * 1e9), "HiCache host pool", asking=f"--hicache-size {size_gb} asks for")


def help_text() -> str:
    """What the adapter adds to SGLang's server: printed after SGLang's own ``--help``."""
    lines = [
        "",
        "hicache-sglang (python -m hicache_sglang.launch_server): SGLang's server with hicache host pools.",
        "  With --enable-hierarchical-cache, SGLang's KV host pools are hicache pools: the layout is",
        "  --hicache-mem-layout, the io backend --hicache-io-backend (after SGLang's own resolution), sized by",
        "  --hicache-ratio / --hicache-size. Works on CPU servers too (SGLANG_USE_CPU_ENGINE=1 --device cpu).",
        f"  io backend 'direct' drives only layouts {' and '.join(DIRECT_LAYOUTS)} (SGLang's controller).",
        "  Each pool built logs one line 'hicache-sglang host pool: ...' naming class, layout, io backend",
        "  and the implementation per operation.",
    ]
    lines += _installed_lines()
    lines.append("  Environment:")
    lines += [f"    {name}: {meaning}" for name, meaning in environment().items()]
    lines.append("  L3: --hicache-storage-backend file (SGLang's) works on hicache pools; see hicache's README.")
    return "\n".join(lines)


def _installed_lines() -> list[str]:
    try:
        from hicache_core.plugins.registry import get_registry

        registry = get_registry()
    except Exception as exc:  # noqa: BLE001 - help must print even when a plugin is broken
        return [f"  hicache plugins could not be listed: {type(exc).__name__}: {exc}"]
    out = ["  Installed hicache io backends (their implementations, best first):"]
    for io in registry.io_backends():
        out.append(f"    {io}: {', '.join(impl.name for impl in registry.candidates(io))}")
    out += [
        "  Layouts (--hicache-mem-layout) SGLang's controller drives on hicache pools: with io backend 'kernel'",
        "  layer_first, page_first, page_head (MHA), page_first_kv_split (MLA); with 'direct' layer_first and",
        "  page_first_direct. SGLang rewrites page_first+direct to page_first_direct and page_first_direct+kernel",
        "  to direct. 'hicache explain' says which implementation serves a pool kind, layout and operation.",
    ]
    failed = registry.failed_plugins()
    if failed:
        out.append("  Plugins that failed to load: " + "; ".join(f"{r.name}: {' | '.join(r.errors)}" for r in failed))
    return out


def wrap_prepare_server_args(original):
    """SGLang's ``prepare_server_args`` with hicache's ``--help`` section and :func:`check` after it."""

    def prepare_server_args(argv: list[str]):
        try:
            server_args = original(argv)
        except SystemExit as exc:
            if exc.code in (0, None) and any(a in ("-h", "--help") for a in argv):
                print(help_text())
            raise
        try:
            check(server_args)
        except (NotServedError, SettingError) as exc:
            print(f"hicache-sglang: refusing to start: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        return server_args

    prepare_server_args.__wrapped__ = original
    return prepare_server_args
