"""Install the adapter into a running SGLang: its ``build_kv_host_pool`` becomes hicache's."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import sys
import threading
from typing import Any

from .errors import NotServedError

#: The SGLang release this adapter is written and tested against. Its host-pool API changes
#: between releases (0.5.23 alone added the *_physical entry points and DevicePoolInfo), so
#: any other version is refused rather than served by guesswork.
SGLANG_VERSION = "0.5.23"
ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
_PARAMETERS = (
    "kv_pool",
    "page_size",
    "use_mla",
    "override_kv_cache_dim",
    "host_size",
    "mtp_draft_device_pools",
    "pool_label",
)
_lock = threading.Lock()
_log = logging.getLogger("hicache_sglang")
_original: Any = None
_patched: list[tuple[Any, str]] = []


def sglang_version() -> str | None:
    """The installed SGLang's version, or None when SGLang is not installed."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def install() -> None:
    """Make SGLang build its KV host pools with hicache, in this process. Idempotent.

    Replaces ``build_kv_host_pool`` in SGLang's pool assembler (and in every module that
    imported it by name already), so the radix tree, the hybrid stacks and the decode
    offload path all get :class:`~hicache_sglang.SGLangHostPool` objects. Layout and io
    backend are SGLang's ``--hicache-mem-layout`` and ``--hicache-io-backend``.

    :raises NotServedError: SGLang is missing, or is not version 0.5.23, or its
        ``build_kv_host_pool`` does not take the arguments 0.5.23's does.
    """
    global _original
    version = sglang_version()
    if version != SGLANG_VERSION:
        found = "SGLang is not installed" if version is None else f"SGLang {version} is installed"
        raise NotServedError(
            f"hicache-sglang serves SGLang {SGLANG_VERSION} exactly; {found}. SGLang's host-pool API changes "
            f"between releases, so another version is not served by guesswork: install sglang=={SGLANG_VERSION}, "
            "or run SGLang without hicache_sglang.install()."
        )
    with _lock:
        if _original is not None:
            return
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        from .build import build_kv_host_pool
        from .pool import SGLangMHAHostPool, SGLangMLAHostPool

        assembler = importlib.import_module(ASSEMBLER)
        original = assembler.build_kv_host_pool
        params = inspect.signature(original).parameters
        kinds = {p.kind for p in params.values()}
        if tuple(params) != _PARAMETERS or kinds != {inspect.Parameter.KEYWORD_ONLY}:
            raise NotServedError(
                f"{ASSEMBLER}.build_kv_host_pool takes ({', '.join(params)}); SGLang {SGLANG_VERSION}'s takes the "
                f"keyword-only arguments ({', '.join(_PARAMETERS)}). This SGLang is modified; not served."
            )
        # SGLang picks code paths (storage key suffixes, draft handling) with isinstance on its own host
        # pool classes; registering ours as virtual subclasses gives them the MHA/MLA answer without
        # inheriting a line of SGLang's transfer code.
        MHATokenToKVPoolHost.register(SGLangMHAHostPool)
        MLATokenToKVPoolHost.register(SGLangMLAHostPool)
        for module in list(sys.modules.values()):
            if getattr(module, "build_kv_host_pool", None) is original:
                module.build_kv_host_pool = build_kv_host_pool
                _patched.append((module, "build_kv_host_pool"))
        # The other host-pool families (families.py), each constructor in the one module SGLang calls it from.
        from . import builders

        builders.install()
        # Layer-wise loads of hicache pools off the scheduler thread (HICACHE_SGLANG_LAYER_LOADS).
        from . import layer_loads

        layer_loads.install()
        # In-place weight updates move hicache's L3 and peer keys to the new weights' version.
        from . import weight_updates

        weight_updates.install()
        # POST /hicache/pin_prefix, unpin_prefix, prefetch: leases in hicache's stores (SGLang 0.5.23 has no pin API).
        from . import retention

        retention.install()
        _original = original


def uninstall() -> None:
    """Give SGLang its own ``build_kv_host_pool`` back (pools already built stay hicache's)."""
    global _original
    with _lock:
        from . import builders, layer_loads, retention, weight_updates

        retention.uninstall()
        weight_updates.uninstall()
        layer_loads.uninstall()
        builders.uninstall()
        for module, name in _patched:
            setattr(module, name, _original)
        _patched.clear()
        _original = None


def is_installed() -> bool:
    """Whether SGLang's ``build_kv_host_pool`` is hicache's in this process."""
    if _original is None:
        return False
    from .build import build_kv_host_pool

    return getattr(sys.modules.get(ASSEMBLER), "build_kv_host_pool", None) is build_kv_host_pool
