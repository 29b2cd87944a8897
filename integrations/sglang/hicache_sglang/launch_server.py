"""``python -m hicache_sglang.launch_server <sglang's arguments>``: SGLang's server, with hicache host pools.

It installs the adapter, then runs SGLang's own launcher with the same arguments.
SGLang starts its scheduler processes with ``spawn``; a spawned process re-imports this
module (as ``__mp_main__``), so the install at import time runs there too. For processes
SGLang starts otherwise, ``HICACHE_SGLANG=1`` makes SGLang's plugin loader install it.
"""

from __future__ import annotations

import os
import sys

from hicache_sglang._sglang_plugin import ENV
from hicache_sglang.installer import install

os.environ[ENV] = "1"
install()


def main(argv: list[str] | None = None) -> None:
    """Run SGLang's launcher (``sglang.launch_server``) on ``argv`` (default: the command line)."""
    import runpy

    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    # alter_sys=False keeps this module as __main__: SGLang's spawned processes re-import __main__,
    # and must import this one (which installs the adapter), not SGLang's launcher.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
