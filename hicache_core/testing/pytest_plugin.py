"""The conformance kit's pytest plugin (entry point ``pytest11``: ``hicache``).

It generates the cases of :class:`hicache_core.testing.ConformanceTests`
subclasses, and runs their cases in the case worker where the class isolates them
(:mod:`hicache_core.testing.isolated`). For every other test it does nothing: the hooks return at once, and
this module imports nothing of its own beyond pytest (what Python loads for the
``hicache_core`` package itself is the package's business).
"""

from __future__ import annotations

import sys
from typing import Any


def pytest_generate_tests(metafunc: Any) -> None:
    """Parametrize the tests of a conformance class with cases from its implementation's claims."""
    cls = metafunc.cls
    generate = getattr(cls, "hicache_parametrize", None) if cls is not None else None
    if generate is not None:
        generate(metafunc)


def pytest_pyfunc_call(pyfuncitem: Any) -> bool | None:
    """Run a conformance case in the case worker when its class isolates cases (``None``: pytest runs it)."""
    cls = pyfuncitem.cls
    run = getattr(cls, "hicache_run_isolated", None) if cls is not None else None
    return run(pyfuncitem) if run is not None else None


def pytest_sessionfinish(session: Any) -> None:
    """Stop the case worker, if this session started one."""
    isolated = sys.modules.get("hicache_core.testing.isolated")
    if isolated is not None:
        isolated.stop_worker()
