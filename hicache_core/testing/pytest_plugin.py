"""The conformance kit's pytest plugin (entry point ``pytest11``: ``hicache``).

It generates the cases of :class:`hicache_core.testing.ConformanceTests`
subclasses. For every other test it does nothing: the hook returns at once, and
this module imports nothing of its own beyond pytest (what Python loads for the
``hicache_core`` package itself is the package's business).
"""

from __future__ import annotations

from typing import Any


def pytest_generate_tests(metafunc: Any) -> None:
    """Parametrize the tests of a conformance class with cases from its implementation's claims."""
    cls = metafunc.cls
    generate = getattr(cls, "hicache_parametrize", None) if cls is not None else None
    if generate is not None:
        generate(metafunc)
