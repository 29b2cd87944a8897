"""The peer tier between real processes: pages read from another instance's host pool through NIXL (UCX/TCP)."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from peer_proc import CASE, MODEL, TEST_OPTIONS, page_content

from hicache_core.storage import make_storage
from hicache_core.storage.backend import PageStatus, StorageError
from hicache_core.testing.storage_kit import StorageCase, make_pool

N = 16


def reader_store(url: str, **kw):
    host = make_pool(CASE, pages=2 * N, seed=9)
    store = make_storage(url, host, model_id=kw.pop("model_id", MODEL), serve=0, **kw)
    return host, store, host.alloc(N * CASE.page_size)


def page_of(host, slots, i):
    return host.get_data_page(int(slots[i * CASE.page_size]), flat=True).view(torch.uint8)


def test_reader_gets_the_owners_pages_byte_for_byte(shared_owner):
    keys = shared_owner.keys
    host, store, slots = reader_store(shared_owner.url)
    try:
        assert store.batch_exists(keys) == N
        results = store.read_pages(keys, slots)
        assert [r.status for r in results] == [PageStatus.OK] * N, results[:2]
        for i, key in enumerate(keys):
            assert torch.equal(page_of(host, slots, i), page_content(host, key)), f"page {i} differs"
        stats = store.get_stats()
        assert stats.pages_read == N and stats.backend["transfers"] >= 2  # the pages, then the generation words
        from hicache_core.storage.explain import explain_miss

        toks = [(1 * 7919 + i) % 50000 for i in range((N + 2) * CASE.page_size)]  # peer_proc.keys_for(1, N + 2)
        reasons = [p.reason for p in explain_miss(store, toks).pages]
        assert reasons == ["in_store"] * N + ["not_in_store"] * 2, reasons
    finally:
        store.close()


def test_other_model_geometry_or_rank_share_is_never_found(shared_owner):
    keys, url = shared_owner.keys, shared_owner.url
    for kw in ({"model_id": "another-model"}, {"tp_rank": 1, "tp_size": 2}):
        host, store, _ = reader_store(url, **kw)
        try:
            assert store.batch_exists(keys) == 0, kw
        finally:
            store.close()
    other = make_pool(StorageCase("mha", "page_first", "plain", 1), pages=2 * N * 4, seed=1)  # another page size
    store = make_storage(url, other, model_id=MODEL, serve=0)
    try:
        assert store.batch_exists(keys) == 0
        host, same, _ = reader_store(url)  # the negative control: the owner's own model and geometry find them
        try:
            assert same.batch_exists(keys) == N
        finally:
            same.close()
    finally:
        store.close()


def area_of(pages: int) -> str:
    """A ``publish_bytes`` option that holds exactly ``pages`` pages of CASE (slots start on 64 bytes).

    A slot holds a page's payload and, where the kit's pools verify (HICACHE_VERIFY=1 with a key), its checksum row.
    """
    from hicache_core.storage.pages import PageMap

    pm = PageMap(make_pool(CASE, pages=2, seed=0))
    page = pm.page_bytes + pm.trailer_bytes
    return f"&publish_bytes={pages * -(-page // 64) * 64}"


def test_a_page_evicted_behind_a_stale_directory_is_a_miss_never_its_new_bytes(redis_server, peer_url):
    """The owner's area holds 4 pages; 4 others evict them into the same slots; the directory is put back as it was
    before: the generation words catch it."""
    import redis
    from peer_proc import fill, keys_for

    owner_host = make_pool(CASE, pages=2 * N, seed=1)
    owner = make_storage(peer_url + area_of(4), owner_host, model_id=MODEL)
    host, store, slots = reader_store(peer_url)
    try:
        keys, others = keys_for(5, 4), keys_for(6, 4)
        src = owner_host.alloc(8 * CASE.page_size)
        fill(owner_host, src, keys + others)
        assert all(r.ok for r in owner.write_pages(keys, src[: 4 * CASE.page_size]))
        client = redis.Redis(port=redis_server.port)
        prefix = peer_url.split("prefix=")[1].split("&")[0]
        saved = {k: client.hgetall(k) for k in client.scan_iter(match=f"{prefix}page:*")}
        assert len(saved) == 4 and all(saved.values()), saved
        assert all(r.ok for r in owner.write_pages(others, src[4 * CASE.page_size :]))  # evicts the first 4
        counters = owner.backend.counters
        deadline = time.monotonic() + 5
        while counters["unpublished"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)  # the owner unpublishes in the background; restore after it did
        assert (counters["evicted"], counters["unpublished"]) == (4, 4) and store.batch_exists(keys) == 0
        for k, fields in saved.items():  # a stale directory: the old entries are back
            client.hset(k, mapping=fields)
        assert store.batch_exists(keys) == 4  # the directory says yes ...
        results = store.read_pages(keys, slots[: 4 * CASE.page_size])
        assert [r.status for r in results] == [PageStatus.MISSING] * 4, results  # ... the generations say no
        assert store.get_stats().backend["stale_reads"] == 4
        assert store.get_stats().read_corrupt == 0
        results = store.read_pages(others, slots[: 4 * CASE.page_size])  # the pages that took the slots read whole
        assert all(r.ok for r in results), results
        assert torch.equal(page_of(host, slots, 2), page_content(host, others[2]))
    finally:
        store.close()
        owner.close()


def test_what_the_owner_publishes_is_a_copy_its_pool_can_reuse(peer_url):
    """Freeing and refilling the owner's host slots changes nothing a reader gets: the area holds a copy. The area
    and its words are exact-size host memory, counted under the owner's label, and released at close."""
    from peer_proc import fill, keys_for

    from hicache_core.host_memory import live_records

    owner_host = make_pool(CASE, pages=2 * N, seed=1)
    owner = make_storage(peer_url, owner_host, model_id=MODEL)
    b = owner.backend
    label = f"peer:// publication area of {b.owner_id}"
    mine = lambda: sorted((r.label, r.asked) for r in live_records() if r.label.startswith(label))  # noqa: E731
    assert mine() == [(f"{label}: generations", 8 * b.slots), (f"{label}: publication area", b.slots * b.slot_bytes)]
    assert b.slots * b.slot_bytes <= 4 << 20 < (b.slots + 1) * b.slot_bytes  # publish_bytes=4MiB, whole slots
    host, store, slots = reader_store(peer_url)
    try:
        keys = keys_for(7, 4)
        src = owner_host.alloc(4 * CASE.page_size)
        fill(owner_host, src, keys)
        assert all(r.ok for r in owner.write_pages(keys, src))
        owner_host.free(src)
        fill(owner_host, owner_host.alloc(4 * CASE.page_size), keys_for(8, 4))  # other bytes in the same slots
        results = store.read_pages(keys, slots[: 4 * CASE.page_size])
        assert all(r.ok for r in results), results
        assert all(torch.equal(page_of(host, slots, i), page_content(host, keys[i])) for i in range(4))
    finally:
        store.close()
        owner.close()
    assert mine() == []


def test_owner_evicting_under_load_never_gives_wrong_bytes(peer_url, procs, tmp_path):
    owner = procs("churn", peer_url + area_of(N), tmp_path)  # every round evicts: slots reused under the reads
    keys = owner.ready()["keys"]
    host, store, slots = reader_store(peer_url)
    ok = missed = 0
    try:
        # Read for at least a second and until both outcomes were seen (a page read whole, a page freed under
        # the read), three seconds at most.
        start = time.monotonic()
        while time.monotonic() - start < 3.0 and not (ok and missed and time.monotonic() - start > 1.0):
            for i, r in enumerate(store.read_pages(keys, slots)):
                if r.ok:
                    ok += 1
                    assert torch.equal(page_of(host, slots, i), page_content(host, keys[i])), f"wrong bytes {i}"
                else:
                    assert r.status in (PageStatus.MISSING, PageStatus.SKIPPED), r
                    missed += 1
        stats = store.get_stats()
        assert stats.read_corrupt == 0 and stats.read_mismatch == 0
    finally:
        store.close()
    final = owner.stop()
    assert final["rounds"] > 0 and ok > 0, (final, ok, missed)


def test_paused_owner_times_out_bounded_and_no_late_byte_lands(peer_url, procs, tmp_path):
    owner = procs("owner", peer_url, tmp_path)
    keys = owner.ready()["keys"]
    host, store, slots = reader_store(peer_url)
    try:
        assert all(r.ok for r in store.read_pages(keys, slots))  # connected
        owner.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        results = store.read_pages(keys, slots)
        took = time.monotonic() - t0
        assert took < 4.0, took  # timeout=2 in the URL
        assert all(r.status in (PageStatus.TIMEOUT, PageStatus.SKIPPED) for r in results), results[:2]
        assert store.get_stats().backend["transfer_timeouts"] == 1
        sentinel = torch.full_like(page_of(host, slots, 0), 0x5A)
        dummy = host.get_data_page(0, flat=True)
        for i in range(N):  # a flat page is a copy: write through the pool's own setter
            host.set_from_flat_data_page(int(slots[i * CASE.page_size]), sentinel.view(dummy.dtype))
        assert all(torch.equal(page_of(host, slots, i), sentinel) for i in range(N))
        owner.signal(signal.SIGCONT)
        time.sleep(0.5)
        assert all(torch.equal(page_of(host, slots, i), sentinel) for i in range(N)), "a late read wrote a slot"
        deadline = time.monotonic() + 8  # the owner is suspended for 2 timeouts, then read again (reconnected)
        while True:
            results = store.read_pages(keys, slots)
            if all(r.ok for r in results):
                break
            assert time.monotonic() < deadline and results[0].status is PageStatus.TIMEOUT, results[:2]
            time.sleep(0.3)
        assert torch.equal(page_of(host, slots, 3), page_content(host, keys[3]))
    finally:
        store.close()
    owner.stop()


def test_owner_killed_mid_read_fails_bounded_and_its_entries_expire(peer_url, procs, tmp_path):
    peer_url = peer_url.replace("&lease=3", "&lease=1")  # the entries expire one lease after the kill
    owner = procs("owner", peer_url, tmp_path)
    keys = owner.ready()["keys"]
    host, store, slots = reader_store(peer_url)
    try:
        owner.signal(signal.SIGSTOP)  # the read below starts and cannot finish
        out: list = []
        reading = threading.Thread(target=lambda: out.append(store.read_pages(keys, slots)))
        reading.start()
        time.sleep(0.5)
        owner.kill()
        reading.join(6.0)
        assert not reading.is_alive(), "the read did not return"
        assert not any(r.ok for r in out[0]), out[0][:2]
        time.sleep(1.0)  # lease=1, lapsing since the owner stopped (the read above took timeout=2)
        assert store.batch_exists(keys) == 0
        assert store.get_stats().backend["expired_entries"] >= 1
    finally:
        store.close()


def test_directory_down_is_reported_and_a_restarted_one_is_refilled(tmp_path, procs, own_redis):
    server = own_redis
    url = f"peer://127.0.0.1:{server.port}/0?timeout=1&lease=1.5{TEST_OPTIONS}"
    try:
        keys = procs("owner", url, tmp_path / "o").ready()["keys"]
        host, store, slots = reader_store(url)
        try:
            server.kill()
            t0 = time.monotonic()
            with pytest.raises(StorageError, match="directory 127.0.0.1"):
                store.batch_exists(keys)
            results = store.read_pages(keys, slots)
            assert all(r.status is PageStatus.ERROR for r in results) and "directory" in results[0].detail
            assert time.monotonic() - t0 < 4.0
            server.start()  # same port, empty
            deadline = time.monotonic() + 5.0
            while store.batch_exists(keys) < N and time.monotonic() < deadline:
                time.sleep(0.1)  # the owner's heartbeat finds its lease gone and republishes
            results = store.read_pages(keys, slots)
            assert all(r.ok for r in results), results[:2]
            assert torch.equal(page_of(host, slots, 0), page_content(host, keys[0]))
        finally:
            store.close()
    finally:
        server.stop()


def test_a_reader_killed_mid_read_leaves_the_owner_serving_others(shared_owner, procs):
    """The shared owner's final check (conftest) adds: its registrations and pages unchanged, no heartbeat failed."""
    keys, url = shared_owner.keys, shared_owner.url
    dying = procs("reader", url, shared_owner.proc.workdir)
    dying.wait_for("reader-started")
    time.sleep(0.3)  # reading in a loop now
    dying.signal(signal.SIGKILL)
    host, store, slots = reader_store(url)
    try:
        assert all(r.ok for r in store.read_pages(keys, slots))
        assert torch.equal(page_of(host, slots, N - 1), page_content(host, keys[-1]))
    finally:
        store.close()
    assert shared_owner.proc.proc.poll() is None, "the owner died with its reader"


def test_bad_options_are_refused_before_anything_opens(peer_url):
    with pytest.raises(ValueError, match="lease"):
        make_storage(peer_url + "&lease=0")
    with pytest.raises(ValueError, match="database number"):
        make_storage(peer_url.replace("/0?", "/x?"))
    with pytest.raises(ValueError, match="does not take option"):
        make_storage(peer_url + "&capacity=1")


def test_demo_second_instance_serves_the_prefix_from_the_first_ones_host_tier(peer_url, capfd):
    """``hicache demo --storage peer://... --writer-stays``: process 2 prefetches process 1's prefix through the
    storage controller while process 1 holds it, and loads the same bytes to its device pool. The command runs
    in this process (its two processes are its own children, UCX over TCP from this process's environment)."""
    from hicache_core.cli import main

    code = main(["demo", "--storage", peer_url + "&publish_bytes=64MiB", "--writer-stays", "--device", "cpu"])
    captured = capfd.readouterr()
    out = "\n".join(line for line in captured.out.splitlines() if "NIXL INFO" not in line)
    assert code == 0, out + captured.err[-2000:]
    assert "found 32 of 32 pages, prefetched 32" in out and "pages_read 32," in out and "read_corrupt 0" in out
    assert "the bytes match what process 1 computed" in out


def test_pages_of_replaced_weights_are_never_read_from_a_peer(peer_url):
    """An owner publishes v1's pages; a reader on v2 never finds them (``old_weight_version``), nor the owner's
    own v2 pages until its host pool, which held v1's, was cleared; then v2's pages are read byte for byte."""
    from peer_proc import fill, keys_for

    from hicache_core.storage.explain import explain_miss

    owner_host = make_pool(CASE, pages=2 * N, seed=1)
    owner = make_storage(peer_url, owner_host, model_id=MODEL, weight_version="v1")
    host, store, slots = reader_store(peer_url, weight_version="v1")
    try:
        keys = keys_for(7, 4)
        src = owner_host.alloc(4 * CASE.page_size)
        fill(owner_host, src, keys)
        assert all(r.ok for r in owner.write_pages(keys, src))
        assert store.batch_exists(keys) == 4  # the same weights: found
        store.set_weight_version("v2")
        assert store.batch_exists(keys) == 0
        toks = [(7 * 7919 + i) % 50000 for i in range(4 * CASE.page_size)]  # peer_proc.keys_for(7, 4)
        assert [p.reason for p in explain_miss(store, toks).pages] == ["old_weight_version"] * 4
        owner.set_weight_version("v2")  # the owner's host pool still holds v1's pages: it publishes nothing
        held = owner.write_pages(keys, src)
        assert [r.status for r in held] == [PageStatus.SKIPPED] * 4 and store.batch_exists(keys) == 0
        owner_host.clear()  # the server's cache reset: v1's pages leave the host tier (and the directory)
        again = owner_host.alloc(4 * CASE.page_size)
        fill(owner_host, again, keys)
        assert all(r.ok for r in owner.write_pages(keys, again))
        assert store.batch_exists(keys) == 4
        results = store.read_pages(keys, slots[: 4 * CASE.page_size])
        assert [r.status for r in results] == [PageStatus.OK] * 4, results
        for i, key in enumerate(keys):
            assert torch.equal(page_of(host, slots, i), page_content(host, key))
    finally:
        store.close()
        owner.close()


def gpu_like_pools(pages: int):
    """A device pool and a verifying host pool behind it, as a GPU server makes them by default (a CPU pool verifies
    only when asked): 2 layers, 2 KV heads of head_dim 64, 16-token pages; 16384 payload bytes a page, 64 of
    checksum row after it."""
    from hicache_core import MHADevicePool, make_host_pool

    device = MHADevicePool(size=pages * 16, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=2,
                           device="cpu")  # fmt: skip
    return device, make_host_pool(device, layout="page_first", io_backend="auto", size=pages * 16, verify=True)


@pytest.mark.parametrize("keyed", [False, True], ids=["insecure-no-key", "cluster-key"])
def test_a_verifying_pool_publishes_and_a_verifying_reader_loads_its_pages_byte_exact(peer_url, keyed):
    """The owner backs up device KV into its verifying host pool (checksums taken at backup) and publishes 4 pages,
    each with its checksum row; another instance reads them into its own verifying host pool and loads them to its
    device pool: the rows pass the verifier's check and the device holds the owner's KV byte for byte."""
    import os

    from hicache_core.storage.keys import page_hashes
    from hicache_core.storage.page_auth import ClusterKey
    from hicache_core.verification.page_checksum import NO_CHECKSUM

    key = ClusterKey(os.urandom(32).hex().encode(), "the test") if keyed else None
    owner_dev, owner_host = gpu_like_pools(8)
    reader_dev, reader_host = gpu_like_pools(8)
    gen = torch.Generator().manual_seed(17)
    for buf in owner_dev.k_buffer + owner_dev.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    owner = make_storage(peer_url, owner_host, model_id=MODEL, cluster_key=key)
    reader = make_storage(peer_url, reader_host, model_id=MODEL, serve=0, cluster_key=key)
    try:
        assert (owner.pages.page_bytes, owner.pages.trailer_bytes) == (16384, 64)
        assert owner.backend.slot_bytes == 16448 and owner.authenticated == keyed
        src_dev = torch.arange(32, 96)  # device slots of 4 pages
        src = owner_host.alloc(64)
        owner_host.backup_from_device_all_layer(owner_dev, src, src_dev, "auto")
        keys = page_hashes(list(range(64)), 16)
        written = owner.write_pages(keys, src)
        assert [r.status for r in written] == [PageStatus.OK] * 4, written
        dst = reader_host.alloc(64)
        read = reader.read_pages(keys, dst)
        assert [r.status for r in read] == [PageStatus.OK] * 4, read
        stored = lambda store, page: b"".join(bytes(s.view) for s in store.pages.object_spans(page))  # noqa: E731
        for a, b in zip(src[::16].tolist(), dst[::16].tolist()):  # the payload and its checksum row, as written
            assert len(stored(reader, b // 16)) == 16448 and stored(reader, b // 16) == stored(owner, a // 16), b
        rows = reader_host.verification.table[dst[::16] // 16]
        assert not (rows == NO_CHECKSUM).any()  # rows to check against (an unset one is taken, not checked)
        dst_dev = torch.arange(0, 64)
        for layer in range(2):
            reader_host.load_to_device_per_layer(reader_dev, dst, dst_dev, layer, "auto")
        reader_host.check_verified()
        assert reader_host.verify_stats()["failed_pages"] == 0, reader_host.verify_stats()
        for layer in range(2):
            assert torch.equal(reader_dev.k_buffer[layer][dst_dev].view(torch.uint8),
                               owner_dev.k_buffer[layer][src_dev].view(torch.uint8)), layer  # fmt: skip
            assert torch.equal(reader_dev.v_buffer[layer][dst_dev].view(torch.uint8),
                               owner_dev.v_buffer[layer][src_dev].view(torch.uint8)), layer  # fmt: skip
    finally:
        reader.close()
        owner.close()
