"""hicache-sglang's environment variables, each declared once (the adapter's modules import them from here).

A light module: ``hicache settings`` lists them through the ``hicache.settings`` entry point without
importing torch or SGLang.
"""

from __future__ import annotations

from hicache_core.settings import Setting, choice, flag, number, text
from hicache_core.storage.url import redact_url

INSTALL = flag("HICACHE_SGLANG", doc="1 installs the adapter in every process SGLang starts (launch_server sets it)")
STORAGE_URL = text("HICACHE_SGLANG_STORAGE_URL", takes="a storage URL (file:///dir, redis://host:port/db, ...)",
                   doc="hicache storage's URL when --hicache-storage-backend-extra-config names none",
                   show=redact_url, secret=True)  # fmt: skip
#: ``sglang`` lets SGLang's HiSparse swap-in kernels read hicache's host pool (unset: HiSparse is refused).
HISPARSE_SWAP_IN = choice("HICACHE_SGLANG_HISPARSE_SWAP_IN", ("sglang",),
                          doc="sglang: serve --enable-hisparse (its swap-in: SGLang's kernels)")  # fmt: skip
#: GiB of host memory SGLang's HiCache budget keeps free (SGLang 0.5.23 fixes 10 GiB).
HOST_RESERVE_GIB = number("HICACHE_SGLANG_HOST_RESERVE_GIB", unit="GiB",
                          doc="host memory SGLang's HiCache budget keeps free (SGLang: 10 GiB, fixed)")  # fmt: skip
METRICS_INTERVAL = number("HICACHE_METRICS_INTERVAL", above=True, unit="seconds", default=5.0,
                          doc="seconds between syncs of hicache's metrics to SGLang's /metrics "
                              "(default 5)")  # fmt: skip
LAYER_LOADS = choice("HICACHE_SGLANG_LAYER_LOADS", ("hicache", "sglang"), default="hicache",
                     doc="who submits hicache pools' layer-wise loads: hicache (its layer loader, off the scheduler "
                         "thread; the default) or sglang (SGLang's own loop)")  # fmt: skip

SETTINGS: list[Setting] = [INSTALL, STORAGE_URL, HISPARSE_SWAP_IN, HOST_RESERVE_GIB, METRICS_INTERVAL, LAYER_LOADS]
