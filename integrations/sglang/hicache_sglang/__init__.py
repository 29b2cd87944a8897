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

from .errors import NotServedError
from .installer import SGLANG_VERSION, install, is_installed, sglang_version, uninstall
from .pool import SGLangHostPool, SGLangMHAHostPool, SGLangMLAHostPool

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
