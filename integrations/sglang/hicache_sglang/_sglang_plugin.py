"""SGLang general plugin (entry point group ``sglang.srt.plugins``): install the adapter where asked.

SGLang calls its general plugins early in every process it starts (scheduler, detokenizer,
data-parallel controller, Ray actors), including those a plain ``spawn`` of the launcher
would not reach. The adapter is installed only when ``HICACHE_SGLANG=1`` (which
``python -m hicache_sglang.launch_server`` sets), so having the package installed changes
nothing by itself.
"""

from __future__ import annotations

from .variables import INSTALL

ENV = INSTALL.name


def activate() -> None:
    """Install the adapter in this process if ``HICACHE_SGLANG=1``.

    SGLang logs and ignores a plugin that raises; so that a failed install (or a value of
    ``HICACHE_SGLANG`` it does not take) can never leave SGLang serving its own pools
    unnoticed, a failure also makes every KV host pool construction raise it.
    """
    try:
        if not INSTALL.read():
            return
        from .installer import install

        install()
    except Exception as exc:
        _refuse_pools(exc)
        raise


def _refuse_pools(error: Exception) -> None:
    try:
        from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    except Exception:  # SGLang itself does not import: nothing will build a pool
        return

    def build_kv_host_pool(**_kwargs):
        raise RuntimeError(f"{ENV} asked for hicache host pools, but installing hicache-sglang failed") from error

    assembler.build_kv_host_pool = build_kv_host_pool
