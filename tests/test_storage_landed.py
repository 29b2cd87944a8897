"""PageStore.read_pages(on_landed=): each chunk's checked pages handed over as they land (issue 56, item 3).

A ``file://`` store with a small ``io_chunk_bytes`` reads in several chunks. The callback runs on the
caller's thread, in key order, with each chunk's results and offset; at that moment every ``ok`` page of
the chunk is in the host pool byte for byte; a page corrupted on disk (in a middle chunk) is reported
``corrupt`` to the callback and never loaded to the device; and the results are those of a read without
the callback.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hicache_core.storage import make_storage
from hicache_core.storage.outcomes import PageStatus
from hicache_core.testing import explain_kit as kit

PAGES = 7  # written, read in chunks of 2 pages: 2, 2, 2, 1
CORRUPT = 3  # the second page of the second chunk
DST_PAGES = [5, 1, 7, 0, 3, 6, 2]  # the reader's host pages, out of order


def _slots(pages: list[int], page_size: int) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def _page(host, page: int) -> torch.Tensor:
    """A host page's bytes (bf16 compared as bits: equal bytes, whatever the values)."""
    return host.get_data_page(page * host.page_size, flat=True).reshape(-1).view(torch.uint8).clone()


def _rows(dev, rows: torch.Tensor) -> list[torch.Tensor]:
    return [b[rows].view(torch.int16).clone() for b in (*dev.k_buffer, *dev.v_buffer)]


@pytest.fixture
def written(tmp_path):
    """A source host pool whose pages 0..6 hold a random KV (backed up from its device pool) and a
    file:// store holding them, page CORRUPT's payload changed on disk."""
    src = kit.host_pool(pages=8)
    dev = src.device_pool
    gen = torch.Generator().manual_seed(56)
    for b in (*dev.k_buffer, *dev.v_buffer):
        b.copy_(torch.randn(b.shape, generator=gen).to(b.dtype))
    p = src.page_size
    slots = _slots(list(range(PAGES)), p)
    src.backup_from_device_all_layer(dev, slots, slots, "auto")
    keys = [f"landed-{i:02d}" for i in range(PAGES)]
    url = f"file://{tmp_path / 'l3'}"
    writer = make_storage(url, src, model_id="landed", cluster_key=None)
    assert all(r.ok for r in writer.write_pages(keys, slots))
    from hicache_storage_file.backend import HEADER_BLOCK

    path = writer.backend.path_of(writer.namespace.key(keys[CORRUPT]))
    with open(path, "r+b") as f:  # one payload byte flipped, past the header's block
        f.seek(HEADER_BLOCK + 5)
        byte = f.read(1)
        f.seek(HEADER_BLOCK + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    writer.close()
    yield url, src, keys


def _reader(url: str, pages: int = 8):
    dst = kit.host_pool(pages=pages)
    store = make_storage(url, dst, model_id="landed", cluster_key=None)
    store.backend.io_chunk_bytes = 2 * store.pages.page_bytes  # two pages a chunk: four chunks
    return dst, store


def test_chunks_land_in_order_checked_and_only_ok_pages_load(written):
    url, src, keys = written
    dst, store = _reader(url)
    p = dst.page_size
    dev = dst.device_pool
    for b in (*dev.k_buffer, *dev.v_buffer):
        b.zero_()
    dst_slots = _slots(DST_PAGES, p)
    calls: list[tuple[int, list]] = []
    threads: set[int] = set()
    problems: list[str] = []

    def landed(results, offset):
        threads.add(threading.get_ident())
        calls.append((offset, list(results)))
        for i, r in enumerate(results, start=offset):
            if r.ok and not torch.equal(_page(dst, DST_PAGES[i]), _page(src, i)):
                problems.append(f"page {i} reported ok before its bytes were in the host pool")
        ok = [i for i, r in enumerate(results, start=offset) if r.ok]
        if ok:  # the device load of this chunk's checked pages, as a server's would start: key i -> rows of page i
            load = dst.submit_load(dev, _slots([DST_PAGES[i] for i in ok], p), _slots(ok, p), "auto")
            load.result()

    results = store.read_pages(keys, dst_slots, on_landed=landed)

    assert problems == []
    assert threads == {threading.get_ident()}  # the caller's thread
    assert [(o, len(rs)) for o, rs in calls] == [(0, 2), (2, 2), (4, 2), (6, 1)]
    assert [r for _, rs in calls for r in rs] == results  # the same results, in key order
    assert [r.key for r in results] == keys
    bad = results[CORRUPT]
    assert bad.status is PageStatus.CORRUPT and bad.detail == "payload checksum mismatch"
    assert calls[1][1][1] == bad  # reported to the callback of the middle chunk
    assert [r.ok for r in results] == [i != CORRUPT for i in range(PAGES)]
    # The device holds every ok page's KV, byte for byte, and nothing of the corrupt page.
    truth = src.device_pool
    for i in range(PAGES):
        got = _rows(dev, _slots([i], p))
        if i == CORRUPT:
            assert all(int(t.count_nonzero()) == 0 for t in got), "the corrupt page reached the device"
        else:
            want = _rows(truth, _slots([i], p))
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"page {i} differs on the device"
    assert store.get_stats().read_corrupt == 1 and store.get_stats().pages_read == PAGES - 1
    store.close()


def test_results_and_bytes_match_a_read_without_the_callback(written):
    url, src, keys = written
    dst_a, with_cb = _reader(url)
    dst_b, without = _reader(url)
    slots = _slots(DST_PAGES, dst_a.page_size)
    seen: list[int] = []
    a = with_cb.read_pages(keys, slots, on_landed=lambda rs, off: seen.append(off))
    b = without.read_pages(keys, slots)
    assert a == b and seen == [0, 2, 4, 6]
    for i in range(PAGES):
        if i != CORRUPT:
            assert torch.equal(_page(dst_a, DST_PAGES[i]), _page(dst_b, DST_PAGES[i]))
            assert torch.equal(_page(dst_a, DST_PAGES[i]), _page(src, i))
    assert with_cb.get_stats().as_dict()["pages_read"] == without.get_stats().as_dict()["pages_read"]
    with_cb.close()
    without.close()


def test_one_chunk_one_call_and_no_keys_no_call(written):
    url, src, keys = written
    dst = kit.host_pool(pages=8)
    store = make_storage(url, dst, model_id="landed", cluster_key=None)  # the backend's own chunk: one chunk
    calls: list[tuple[int, list]] = []

    def landed(results, offset):
        calls.append((offset, results))

    results = store.read_pages(keys[:3], _slots([4, 2, 6], dst.page_size), on_landed=landed)
    assert calls == [(0, results)] and all(r.ok for r in results)
    assert store.read_pages([], torch.empty(0, dtype=torch.int64), on_landed=landed) == []
    assert len(calls) == 1
    store.close()


def test_a_raising_callback_stops_the_read(written):
    url, src, keys = written
    dst, store = _reader(url)
    slots = _slots(DST_PAGES, dst.page_size)
    offsets: list[int] = []

    def landed(results, offset):
        offsets.append(offset)
        if offset == 2:
            raise RuntimeError("the device load of chunk 2 failed")

    with pytest.raises(RuntimeError, match="the device load of chunk 2 failed"):
        store.read_pages(keys, slots, on_landed=landed)
    assert offsets == [0, 2]  # nothing after the raise
    # The store is usable after: the next read gives every page's outcome.
    again = store.read_pages(keys, slots)
    assert [r.status for r in again] == [PageStatus.CORRUPT if i == CORRUPT else PageStatus.OK for i in range(PAGES)]
    store.close()
