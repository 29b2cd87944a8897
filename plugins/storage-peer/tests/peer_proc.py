"""Processes of the peer tier's tests: an owner that publishes pages, a reader that reads them in a loop.

Run as ``python peer_proc.py ROLE URL WORKDIR [N_PAGES [verify|noverify]]`` (the last for ``guarded``: its host
pool verifies its pages, as a CUDA pool does by default, or not; without it, the kit's pool, which follows the
environment). Each page's bytes are a function of its key (:func:`page_content`), so any process checks any
page it read without asking the owner.
The owner writes ``WORKDIR/ready.json`` (its keys and stats) once its pages are published and
runs until ``WORKDIR/stop`` exists (or it is killed); in role ``churn`` it keeps freeing and
republishing its pages meanwhile (another key in each freed slot); in role ``events`` it publishes KV events.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from hicache_core import make_host_pool
from hicache_core.storage import make_storage
from hicache_core.storage.keys import page_hashes
from hicache_core.testing.cases import build_device_pools, fill_random
from hicache_core.testing.storage_kit import StorageCase, make_pool

CASE = StorageCase("mha", "page_first", "plain", 4)
#: A trusted test setup: no directory password, and no cluster key required (the suite runs with one in the
#: environment too); publication areas sized for the test pools.
TEST_OPTIONS = "&insecure=1&publish_bytes=4MiB"
MODEL = "peer-test"
#: Seconds between two heartbeats of the ``events`` owner's KV-event publisher.
EVENTS_HEARTBEAT = 0.2


def make_peer_pool(pages: int, seed: int, verify: bool | None = None):
    """A host pool of CASE holding ``pages`` pages of random bytes, verifying its pages or not as ``verify`` says.

    A verifying pool stores each page's checksum row after its payload (a CUDA pool's default). ``None``: the
    kit's pool, whose verification follows the environment (HICACHE_VERIFY, where a cluster key is set).
    """
    if verify is None:
        return make_pool(CASE, pages=pages, seed=seed)
    device_pool, _ = build_device_pools(CASE.pool_kind, CASE.variant, CASE.page_size, "cpu")
    p = CASE.page_size
    size = max(pages * p, -(-int(device_pool.size) // p) * p)
    host = make_host_pool(device_pool, layout=CASE.layout, io_backend="reference", operations=[], size=size,
                          verify=verify)  # fmt: skip
    # Behind a verifier's back: these pages have no checksum until fill() sets them through the pool.
    fill_random(list(host.plan.host_buffers.values()), torch.Generator().manual_seed(seed))
    return host


def page_content(host, key: str) -> torch.Tensor:
    """The flat bytes the page ``key`` holds, wherever it lives."""
    n = host.get_data_page(0, flat=True).view(torch.uint8).numel()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(int(key[:12], 16)))


def fill(host, slots: torch.Tensor, keys: list[str]) -> None:
    dummy = host.get_data_page(0, flat=True)
    for slot, key in zip(slots[:: host.page_size].tolist(), keys):
        host.set_from_flat_data_page(slot, page_content(host, key).view(dummy.dtype))


def keys_for(salt: int, n_pages: int) -> list[str]:
    return page_hashes([(salt * 7919 + i) % 50000 for i in range(n_pages * CASE.page_size)], CASE.page_size)


def owner(url: str, workdir: Path, n_pages: int, churn: bool) -> None:
    host = make_pool(CASE, pages=4 * n_pages, seed=3)
    store = make_storage(url, host, model_id=MODEL)
    keys = keys_for(1, n_pages)
    slots = host.alloc(n_pages * CASE.page_size)
    fill(host, slots, keys)
    results = store.write_pages(keys, slots)
    assert all(r.ok for r in results), results[:2]
    backend = getattr(store, "backend", store)
    (workdir / "ready.tmp").write_text(json.dumps({"keys": keys, "stats": backend.backend_stats()}))
    (workdir / "ready.tmp").rename(workdir / "ready.json")
    rounds = 0
    while not (workdir / "stop").exists():
        if not churn:
            time.sleep(0.02)
            continue
        # Evict half the pages, put other pages' bytes in slots just freed, publish them, then bring the
        # first keys back: every slot keeps changing while readers read.
        rounds += 1
        half = n_pages // 2 * CASE.page_size
        host.free(slots[:half])
        other = keys_for(1000 + rounds, n_pages // 2)
        fresh = host.alloc(half)
        fill(host, fresh, other)
        store.write_pages(other, fresh)
        host.free(fresh)
        back = host.alloc(half)
        fill(host, back, keys[: n_pages // 2])
        store.write_pages(keys[: n_pages // 2], back)
        slots = torch.cat([back, slots[half:]])
    stats = backend.backend_stats()
    store.close()
    (workdir / "owner-final.json").write_text(json.dumps({"rounds": rounds, "stats": stats}))


def guarded(url: str, workdir: Path, n_pages: int, verify: bool | None) -> None:
    """An owner that holds ``n_pages`` pages in its pool and publishes only the first half (what outsiders attack).

    ``ready.json`` adds the unpublished keys and the pool's buffers (addresses an attacker might know); at
    ``stop``, ``owner-final.json`` says whether every page of its pool still holds its own bytes.
    """
    host = make_peer_pool(2 * n_pages, 3, verify)
    store = make_storage(url, host, model_id=MODEL)
    keys = keys_for(1, n_pages)
    slots = host.alloc(n_pages * CASE.page_size)
    fill(host, slots, keys)
    half = n_pages // 2
    assert all(r.ok for r in store.write_pages(keys[:half], slots[: half * CASE.page_size]))
    buffers = [(s.ptr, s.nbytes) for s in store.pages.buffer_spans()]
    (workdir / "leaked-metadata.bin").write_bytes(store.backend._agent.metadata())  # what a leak would give
    table = store.pages.table  # a verifying pool's checksum rows: registered nowhere either
    rows = None if table is None else [table.data_ptr(), table.numel() * table.element_size()]
    ready = {"keys": keys[:half], "unpublished": keys[half:], "pool": buffers, "checksum_table": rows,
             "stats": store.backend.backend_stats()}  # fmt: skip
    (workdir / "ready.tmp").write_text(json.dumps(ready))
    (workdir / "ready.tmp").rename(workdir / "ready.json")
    while not (workdir / "stop").exists():
        time.sleep(0.02)
    page = [int(s) for s in slots[:: CASE.page_size].tolist()]
    intact = [bool(torch.equal(host.get_data_page(s, flat=True).view(torch.uint8), page_content(host, k)))
              for s, k in zip(page, keys)]  # fmt: skip
    stats = store.backend.backend_stats()
    store.close()
    (workdir / "owner-final.json").write_text(json.dumps({"rounds": 0, "intact": intact, "stats": stats}))


def events_owner(url: str, workdir: Path, n_pages: int) -> None:
    """An owner that publishes KV events (SGLang's format, heartbeat EVENTS_HEARTBEAT s) of its peer tier and of a
    file:// tier in WORKDIR/l3; ``ready.json`` adds the publisher's endpoints and each tier's store id."""
    from hicache_core.events import KVEventPublisher

    host = make_pool(CASE, pages=2 * n_pages, seed=3)
    publisher = KVEventPublisher("tcp://127.0.0.1:*", format="sglang", replay_endpoint="tcp://127.0.0.1:*",
                                 heartbeat=EVENTS_HEARTBEAT)  # fmt: skip
    stores = [make_storage(url, host, model_id=MODEL), make_storage(f"file://{workdir / 'l3'}", host, model_id=MODEL)]
    feeds = [s.publish_events(publisher, audit_interval=None) for s in stores]
    keys = keys_for(1, n_pages)
    slots = host.alloc(n_pages * CASE.page_size)
    fill(host, slots, keys)
    for store in stores:
        assert all(r.ok for r in store.write_pages(keys, slots))
    ready = {"keys": keys, "endpoint": publisher.endpoint, "replay": publisher.replay_endpoint,
             "stores": [f.tier.store for f in feeds],
             "media": [publisher.format.medium(f.tier) for f in feeds]}  # fmt: skip
    (workdir / "ready.tmp").write_text(json.dumps(ready))
    (workdir / "ready.tmp").rename(workdir / "ready.json")
    while not (workdir / "stop").exists():
        time.sleep(0.02)
    for store in stores:
        store.close()
    publisher.close()
    (workdir / "owner-final.json").write_text(json.dumps({"rounds": 0, "stats": {}}))


def reader(url: str, workdir: Path, n_pages: int) -> None:
    """Read the owner's pages over and over until killed (the test kills it mid-read)."""
    host = make_pool(CASE, pages=2 * n_pages, seed=4)
    store = make_storage(url, host, model_id=MODEL, serve=0)
    keys = json.loads((workdir / "ready.json").read_text())["keys"]
    slots = host.alloc(n_pages * CASE.page_size)
    (workdir / "reader-started").write_text("1")
    while True:
        store.read_pages(keys, slots)


if __name__ == "__main__":
    role, url, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    if role == "reader":
        reader(url, work, n)
    elif role == "events":
        events_owner(url, work, n)
    elif role == "guarded":
        guarded(url, work, n, {"verify": True, "noverify": False}.get(sys.argv[5]) if len(sys.argv) > 5 else None)
    else:
        owner(url, work, n, churn=role == "churn")
