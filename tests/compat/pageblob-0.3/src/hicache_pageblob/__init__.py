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


def page_blob_oracle(host, part: str, layer: int, item: int):
    """Where item ``item`` of part ``part`` of host layer ``layer`` lands, as SGLang's PR #31136 shapes it:
    ``kv_buffer[page, k_or_v, layer, token]`` of ``(P, 2, L, p, H, D)`` where K and V share one buffer, and
    ``buffer[page, layer, token]`` for a part with a buffer of its own (MLA's ``kv_buffer``, separate K and V).
    Written from the shape, not from the axes, so the conformance kit can check the declaration against it."""
    page, token = divmod(item, host.page_size)
    stacked = host.kv_buffer is not None and part in ("k", "v") and host.kv_buffer.dim() == 6
    if stacked:
        return host.kv_buffer[page, {"k": 0, "v": 1}[part], layer, token]
    buffer = host.kv_buffer if part == "kv" else getattr(host, f"{part}_buffer")
    return buffer[page, layer, token]


#: SGLang's proposed ``page_blob_direct``: host shape ``(P, 2, L, p, H, D)``, so one page (every layer,
#: K and V) is a single contiguous blob that L3 storage can write in one piece.
PAGE_BLOB_DIRECT = Layout(
    "page_blob_direct",
    ("page", "component", "layer", "token", "head", "dim"),
    pool_kinds=frozenset({"mha", "mha_asym", "mha_k_only", "mla"}),  # token kinds: pages of tokens
    oracle=page_blob_oracle,
    description="one contiguous blob per page: K and V of every layer, page-major",
)


@hookimpl
def hicache_register_layouts(register: Callable[[Layout], None]) -> None:
    register(PAGE_BLOB_DIRECT)


@hookimpl
def hicache_register_backends(register: Callable[[type[Implementation]], None]) -> None:
    register(PageBlobGather)
