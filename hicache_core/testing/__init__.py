"""hicache's conformance kit for transfer implementations.

A plugin author subclasses :class:`ConformanceTests` in a test module and names
the implementation under test; the kit's pytest plugin (registered through the
``pytest11`` entry point as ``hicache``) generates cases from what that
implementation claims and checks every one against the pure-torch reference::

    from hicache_core.testing import ConformanceTests

    class TestMyBackend(ConformanceTests):
        implementation = "mine.fast_copy"

Attributes are loaded lazily, so importing the pytest plugin stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_face

if TYPE_CHECKING:
    from .cases import Case, build_device_pools
    from .conformance import ConformanceTests

__all__ = ["Case", "ConformanceTests", "build_device_pools"]

_EXPORTS = {
    "Case": "cases",
    "build_device_pools": "cases",
    "ConformanceTests": "conformance",
}

__getattr__, __dir__ = lazy_face(globals(), _EXPORTS)
