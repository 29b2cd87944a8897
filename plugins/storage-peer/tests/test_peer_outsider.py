"""An outsider against the peer tier: its own process and NIXL agent, a real redis-server with a password, no key.

The owner (a process of the cluster, with the cluster key) holds 16 pages in its host pool and publishes 8.
The outsider (``peer_outsider.py``) knows the directory's address and, in the worst case, its password and
the owner's host pool addresses. What it must not get: any unpublished page; any change to what the owner
holds; a forged entry loaded as ``ok`` by a reader of the cluster; and without the password, anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import torch
from peer_proc import CASE, MODEL, page_content

from hicache_core.storage import make_storage
from hicache_core.storage.backend import PageStatus
from hicache_core.testing.servers import start_redis
from hicache_core.testing.storage_kit import make_pool

KEY = "outsider-test-cluster-key-0123456789abcdef"
PASSWORD = "directory-password-4c1d"
HERE = __import__("pathlib").Path(__file__).parent
N = 16


@pytest.fixture
def guarded(tmp_path, procs, monkeypatch):
    """A password-protected directory and a keyed owner process that published half of its 16 pages."""
    monkeypatch.setenv("HICACHE_L3_KEY", KEY)
    monkeypatch.delenv("HICACHE_L3_KEY_FILE", raising=False)
    (tmp_path / "redis").mkdir()
    server = start_redis(tmp_path / "redis", "--requirepass", PASSWORD)
    prefix = f"g{uuid.uuid4().hex[:8]}:"
    url = f"peer://:{PASSWORD}@127.0.0.1:{server.port}/0?prefix={prefix}&timeout=2&lease=3&publish_bytes=4MiB"
    owner = procs("guarded", url, tmp_path / "owner", N)
    try:
        yield server, url, prefix, owner, owner.ready()
    finally:
        server.stop()


def run_outsider(tmp_path, server, prefix, ready, password, leaked=None):
    plan = {"port": server.port, "password": password, "prefix": prefix, "pool": ready["pool"],
            "forge": ready.get("full_keys", ["a", "b", "c"])[:3], "leaked_metadata": leaked}  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    done = subprocess.run([sys.executable, str(HERE / "peer_outsider.py"), str(tmp_path / "plan.json"),
                           str(tmp_path / "outsider.json")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "outsider.json").read_text())


def page_bytes_of(host, keys):
    return [page_content(host, k).numpy().tobytes() for k in keys]


def test_an_outsider_with_the_password_cannot_load_an_owner_and_its_forged_entries_never_load(guarded, tmp_path):
    """A Redis writer who is not of the cluster: the owner's NIXL metadata is sealed, so no NIXL access at all;
    the entries it forges (one copied under another key, one written without the key) are ignored."""
    server, url, prefix, owner, ready = guarded
    host = make_pool(CASE, pages=2 * N, seed=9)
    reader = make_storage(url, host, model_id=MODEL, serve=0)
    try:
        ready["full_keys"] = reader.namespace.keys(ready["keys"])
        slots = host.alloc(N // 2 * CASE.page_size)
        assert all(r.ok for r in reader.read_pages(ready["keys"], slots))  # the cluster reads
        seen = run_outsider(tmp_path, server, prefix, ready, PASSWORD)
        assert seen["directory"] == "ok" and seen["forged"] == "ok", seen
        assert seen["load_metadata"].startswith("refused: TransferFailed: cannot load owner"), seen
        assert "read_area" not in seen and "read_pool" not in seen, seen
        for i in range(N // 2):  # the slots are filled again below: only what this read loads is there
            host.set_from_flat_data_page(int(slots[i * CASE.page_size]),
                                         torch.zeros_like(page_content(host, ready["keys"][i])).view(
                                             host.get_data_page(0, flat=True).dtype))  # fmt: skip
        results = reader.read_pages(ready["keys"], slots)
        assert [r.status for r in results[1:3]] == [PageStatus.MISSING] * 2, results  # forged: never ok
        assert all(r.ok for r in results[:1] + results[3:]), results  # the others untouched
        assert reader.get_stats().backend["bad_entries"] == 2
        for i, k in enumerate(ready["keys"]):
            got = host.get_data_page(int(slots[i * CASE.page_size]), flat=True).view(torch.uint8)
            assert torch.equal(got, page_content(host, k)) == (i not in (1, 2)), i
    finally:
        reader.close()
    assert owner.stop()["intact"] == [True] * N


def test_an_outsider_with_the_owners_metadata_reads_only_published_pages_through_nixl(guarded, tmp_path):
    """Worst case: the owner's NIXL metadata leaked. Through NIXL as it is, the outsider reaches the publication
    area only: pool reads and writes refused, no unpublished page in what it read, its writes into the area make
    the cluster's readers miss, never load. The metadata edited to cover the pool reads it (UCX over TCP checks
    no registration at the target): the limit docs/storage-peer.md states, why the metadata is sealed."""
    server, url, prefix, owner, ready = guarded
    host = make_pool(CASE, pages=2 * N, seed=9)
    reader = make_storage(url, host, model_id=MODEL, serve=0)
    try:
        ready["full_keys"] = reader.namespace.keys(ready["keys"])
        slots = host.alloc(N // 2 * CASE.page_size)
        seen = run_outsider(tmp_path, server, prefix, ready, PASSWORD, str(owner.workdir / "leaked-metadata.bin"))
        assert seen["read_area"] == "ok" and seen["read_gens"] == "ok", seen
        assert len(seen["read_pool"]) >= 1 and all(r.startswith("refused") for r in seen["read_pool"]), seen
        area = (tmp_path / "area.bin").read_bytes()
        assert all(p in area for p in page_bytes_of(host, ready["keys"])), "the area read did not work (no control)"
        assert not any(p in area for p in page_bytes_of(host, ready["unpublished"])), "an unpublished page was read"
        assert all(r.startswith("refused") for r in seen["write_pool"]), seen
        assert seen["write_area"] == "ok" and seen["write_gens"] == "ok", seen
        results = reader.read_pages(ready["keys"], slots)
        assert not any(r.ok for r in results), results
        assert {r.status for r in results} <= {PageStatus.AUTH_FAILED, PageStatus.MISSING}, results
        # The documented limit, pinned: with the metadata edited, UCX/TCP serves the unregistered pool.
        assert seen["widened_read_pool"] == "ok", seen
        pool = (tmp_path / "pool.bin").read_bytes()
        # (the pool's first buffer holds each page's first run: its first 128 bytes are there)
        assert all(p[:128] in pool for p in page_bytes_of(host, ready["unpublished"]))
    finally:
        reader.close()
    assert owner.stop()["intact"] == [True] * N  # nothing it wrote reached the owner's pool


def test_an_outsider_without_the_password_gets_nothing(guarded, tmp_path):
    server, url, prefix, owner, ready = guarded
    ready["full_keys"] = ["a", "b", "c"]
    seen = run_outsider(tmp_path, server, prefix, ready, None)
    assert seen["directory"].startswith("refused: AuthenticationError"), seen
    assert seen["directory_write"].startswith("refused: AuthenticationError"), seen
    assert set(seen) == {"directory", "directory_write"}, seen
    host = make_pool(CASE, pages=2 * N, seed=9)
    reader = make_storage(url, host, model_id=MODEL, serve=0)
    try:
        slots = host.alloc(N // 2 * CASE.page_size)
        got = reader.read_pages(ready["keys"], slots)
        assert all(r.ok for r in got), got  # nothing changed for the cluster
        for i, k in enumerate(ready["keys"]):
            page = host.get_data_page(int(slots[i * CASE.page_size]), flat=True).view(torch.uint8)
            assert torch.equal(page, page_content(host, k)), i
    finally:
        reader.close()
    assert owner.stop()["intact"] == [True] * N


def test_a_directory_without_a_password_is_refused_unless_declared_a_test_setup(tmp_path):
    server = start_redis(tmp_path)
    try:
        url = f"peer://127.0.0.1:{server.port}/0?timeout=2"
        with pytest.raises(ValueError, match="has no password.*insecure_directory=1 for a trusted test setup"):
            make_storage(url, make_pool(CASE, pages=4, seed=0), model_id=MODEL)
        store = make_storage(url + "&insecure_directory=1&publish_bytes=1MiB", make_pool(CASE, pages=4, seed=0),
                             model_id=MODEL)  # fmt: skip
        store.close()
    finally:
        server.stop()
