"""hicache-pageblob: the layout ``page_blob_direct`` and the io backend ``"blob"``.

An example of a plugin as a third party ships it: its own distribution, found by
hicache through the ``hicache`` entry point in ``pyproject.toml``. Importing it is
cheap (declarations only); nothing runs until hicache calls the hooks below.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache_core import Implementation, Layout, hookimpl

from .gather import PageBlobGather

__all__ = ["PAGE_BLOB_DIRECT", "PageBlobGather"]

#: SGLang's proposed ``page_blob_direct``: host shape ``(P, 2, L, p, H, D)``, so one page (every layer,
#: K and V) is a single contiguous blob that L3 storage can write in one piece.
PAGE_BLOB_DIRECT = Layout(
    "page_blob_direct",
    ("page", "component", "layer", "token", "head", "dim"),
    description="one contiguous blob per page: K and V of every layer, page-major",
)


@hookimpl
def hicache_register_layouts(register: Callable[[Layout], None]) -> None:
    register(PAGE_BLOB_DIRECT)


@hookimpl
def hicache_register_backends(register: Callable[[type[Implementation]], None]) -> None:
    register(PageBlobGather)
