"""hicache-sglang: SGLang builds its HiCache KV host pools with hicache.

::

    import hicache_sglang
    hicache_sglang.install()        # before SGLang builds its cache (e.g. first thing in the launcher)

or, for a server::

    python -m hicache_sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-mem-layout page_first --hicache-io-backend kernel

SGLang's controller, radix tree, transfer engine and storage backends then talk to
:class:`SGLangHostPool` objects: hicache pools with SGLang 0.5.23's host-pool members.
"""

from __future__ import annotations

from hicache_core.lazy import lazy_face

from .errors import NotServedError

__all__ = [
    "NotServedError",
    "SGLANG_VERSION",
    "SGLangHostPool",
    "SGLangMHAHostPool",
    "SGLangMLAHostPool",
    "install",
    "is_installed",
    "sglang_version",
    "uninstall",
]
# Lazy, so that its hicache.settings entry point (hicache_sglang.variables) imports neither torch nor SGLang.
__getattr__, __dir__ = lazy_face(globals(), {
    **dict.fromkeys(("SGLANG_VERSION", "install", "is_installed", "sglang_version", "uninstall"), "installer"),
    **dict.fromkeys(("SGLangHostPool", "SGLangMHAHostPool", "SGLangMLAHostPool"), "pool"),
})  # fmt: skip
