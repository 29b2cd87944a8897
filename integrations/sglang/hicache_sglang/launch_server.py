"""``python -m hicache_sglang.launch_server <sglang's arguments>``: SGLang's server, with hicache host pools.

It installs the adapter, then runs SGLang's own launcher with the same arguments, after
checking SGLang's resolved HiCache settings (:mod:`hicache_sglang.startup`: a setting the
adapter cannot serve ends the launcher before SGLang starts a process; ``--help`` adds what
the adapter adds). SGLang starts its scheduler processes with ``spawn``; a spawned process
re-imports this module (as ``__mp_main__``), so the install at import time runs there too.
For processes SGLang starts otherwise, ``HICACHE_SGLANG=1`` makes SGLang's plugin loader
install it.
"""

from __future__ import annotations

import os
import sys

from hicache_sglang._sglang_plugin import ENV
from hicache_sglang.host_memory import apply_host_reserve
from hicache_sglang.installer import install

os.environ[ENV] = "1"
install()
apply_host_reserve()


def main(argv: list[str] | None = None) -> None:
    """Run SGLang's launcher (``sglang.launch_server``) on ``argv`` (default: the command line)."""
    import runpy

    import sglang.srt.server_args as server_args_module

    from hicache_sglang.startup import wrap_prepare_server_args

    # SGLang's launcher imports prepare_server_args by name when runpy executes it, so it gets this one.
    if not hasattr(server_args_module.prepare_server_args, "__wrapped__"):
        server_args_module.prepare_server_args = wrap_prepare_server_args(server_args_module.prepare_server_args)
    sys.argv = ["sglang.launch_server", *(sys.argv[1:] if argv is None else argv)]
    # alter_sys=False keeps this module as __main__: SGLang's spawned processes re-import __main__,
    # and must import this one (which installs the adapter), not SGLang's launcher.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
