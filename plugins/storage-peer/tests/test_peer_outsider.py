"""An outsider against the peer tier: its own process and NIXL agent, a real redis-server with a password, no key.

The owner (a process of the cluster, with the cluster key in a file as docs/security.md says) holds 16 pages in
its host pool and publishes 8; the attacks run against an unverified and a verifying host pool (a GPU server's
default: each page is published with its checksum row).
The outsider (``peer_outsider.py``) knows the directory's address and, in the worst case, its password and
the owner's host pool addresses. What it must not get: any unpublished page; any change to what the owner
holds; a forged entry loaded as ``ok`` by a reader of the cluster; and without the password, anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import redis
import torch
from peer_proc import CASE, MODEL, make_peer_pool, page_content

from hicache_core.host_memory import live_records
from hicache_core.storage import make_storage
from hicache_core.storage.backend import PageStatus
from hicache_core.storage.page_auth import ClusterKey
from hicache_core.testing.servers import start_redis
from hicache_core.testing.storage_kit import make_pool

PASSWORD = "directory-password-4c1d"
HERE = __import__("pathlib").Path(__file__).parent
N = 16
KEY_VARIABLES = ("HICACHE_L3_KEY", "HICACHE_L3_KEY_FILE")
#: Against both host pools: ``verify`` is the guarded fixture's (indirect) parameter. The leaked-metadata test
#: takes it: its outsider makes every attack of the others too (forged entries, the sealed metadata), and each run
#: costs an owner and an outsider process (seconds of CI's 2 cores).
BOTH_POOLS = pytest.mark.parametrize("guarded", [False, True], ids=["unverified", "verifying"], indirect=True)


@pytest.fixture
def guarded(request, tmp_path, procs, monkeypatch):
    """A password-protected directory and a keyed owner process that published half of its 16 pages.

    The key is set as the docs say: a file of 32 random bytes in hex, mode 600, named by HICACHE_L3_KEY_FILE.
    ``request.param``: whether the owner's host pool verifies (the readers' pools follow it); unparametrized, the
    kit's pools, which follow HICACHE_VERIFY.
    """
    verify = getattr(request, "param", None)
    key_file = tmp_path / "l3.key"
    key_file.write_text(os.urandom(32).hex() + "\n")
    key_file.chmod(0o600)
    monkeypatch.delenv("HICACHE_L3_KEY", raising=False)
    monkeypatch.setenv("HICACHE_L3_KEY_FILE", str(key_file))
    (tmp_path / "redis").mkdir()
    server = start_redis(tmp_path / "redis", "--requirepass", PASSWORD)
    prefix = f"g{uuid.uuid4().hex[:8]}:"
    url = f"peer://:{PASSWORD}@127.0.0.1:{server.port}/0?prefix={prefix}&timeout=2&lease=3&publish_bytes=4MiB"
    owner = procs("guarded", url, tmp_path / "owner", N, verify)
    try:
        ready = owner.ready()
        ready["verify"] = verify
        yield server, url, prefix, owner, ready
    finally:
        server.stop()


def run_outsider(tmp_path, server, prefix, ready, password, leaked=None):
    plan = {"port": server.port, "password": password, "prefix": prefix, "pool": ready["pool"],
            "forge": ready.get("full_keys", ["a", "b", "c"])[:3], "leaked_metadata": leaked}  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    outsider_env = {k: v for k, v in os.environ.items() if k not in KEY_VARIABLES}  # an outsider has no key
    done = subprocess.run([sys.executable, str(HERE / "peer_outsider.py"), str(tmp_path / "plan.json"),
                           str(tmp_path / "outsider.json")], capture_output=True, text=True, timeout=120,
                          env=outsider_env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "outsider.json").read_text())


def page_bytes_of(host, keys):
    return [page_content(host, k).numpy().tobytes() for k in keys]


def test_an_outsider_with_the_password_cannot_load_an_owner_and_its_forged_entries_never_load(guarded, tmp_path):
    """A Redis writer who is not of the cluster: the owner's NIXL metadata is sealed, so no NIXL access at all;
    the entries it forges (one copied under another key, one written without the key) are ignored."""
    server, url, prefix, owner, ready = guarded
    host = make_peer_pool(2 * N, 9, ready["verify"])
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


@BOTH_POOLS
def test_an_outsider_with_the_owners_metadata_reads_only_published_pages_through_nixl(guarded, tmp_path):
    """Worst case: the owner's NIXL metadata leaked. Through NIXL as it is, the outsider reaches the publication
    area only: pool reads and writes refused, no unpublished page in what it read, its writes into the area make
    the cluster's readers miss, never load. The metadata edited to cover the pool reads it (UCX over TCP checks
    no registration at the target): the limit docs/storage-peer.md states, why the metadata is sealed. With a
    verifying pool, its checksum table is one more buffer the outsider cannot reach."""
    server, url, prefix, owner, ready = guarded
    host = make_peer_pool(2 * N, 9, ready["verify"])
    reader = make_storage(url, host, model_id=MODEL, serve=0)
    try:
        ready["full_keys"] = reader.namespace.keys(ready["keys"])
        slots = host.alloc(N // 2 * CASE.page_size)
        assert all(r.ok for r in reader.read_pages(ready["keys"], slots))  # the control: the cluster reads them
        seen = run_outsider(tmp_path, server, prefix, ready, PASSWORD, str(owner.workdir / "leaked-metadata.bin"))
        assert seen["forged"] == "ok" and seen["load_metadata"].startswith("refused: TransferFailed"), seen
        assert seen["read_area"] == "ok" and seen["read_gens"] == "ok", seen
        assert len(seen["read_pool"]) == len(ready["pool"]), seen
        assert all(r.startswith("refused") for r in seen["read_pool"]), seen
        assert (ready["checksum_table"] in ready["pool"]) if ready["verify"] else ready["checksum_table"] is None
        area = (tmp_path / "area.bin").read_bytes()
        assert all(p in area for p in page_bytes_of(host, ready["keys"])), "the area read did not work (no control)"
        assert not any(p in area for p in page_bytes_of(host, ready["unpublished"])), "an unpublished page was read"
        assert all(r.startswith("refused") for r in seen["write_pool"]), seen
        assert seen["write_area"] == "ok" and seen["write_gens"] == "ok", seen
        results = reader.read_pages(ready["keys"], slots)
        assert not any(r.ok for r in results), results
        assert {r.status for r in results} <= {PageStatus.AUTH_FAILED, PageStatus.MISSING}, results
        assert reader.get_stats().backend["bad_entries"] == 2  # the forged entries, ignored
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
    host = make_peer_pool(2 * N, 9, ready["verify"])
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
        key = ClusterKey(os.urandom(32).hex().encode(), "the test")
        for options in ("&insecure_directory=1", "&insecure=1"):  # the password only; a trusted setup altogether
            store = make_storage(url + options + "&publish_bytes=1MiB", make_pool(CASE, pages=4, seed=0),
                                 model_id=MODEL, cluster_key=key)  # fmt: skip
            store.close()
    finally:
        server.stop()


def test_peer_without_the_cluster_key_is_refused_before_anything_is_published(tmp_path, monkeypatch):
    """Unkeyed, an owner's NIXL metadata would lie in the directory in clear and forged entries would load: a
    ``peer://`` store is not bound to a pool without the key, as owner or reader, unless the URL says insecure=1
    (insecure_directory=1 waives the password only). Nothing is registered, allocated or written before."""
    for name in KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    peer_memory = lambda: sorted(r.label for r in live_records() if r.label.startswith("peer://"))  # noqa: E731
    before = peer_memory()
    server = start_redis(tmp_path, "--requirepass", PASSWORD)
    try:
        prefix = f"k{uuid.uuid4().hex[:8]}:"
        url = f"peer://:{PASSWORD}@127.0.0.1:{server.port}/0?prefix={prefix}&timeout=2&publish_bytes=1MiB"
        said = (f"peer:// directory 127.0.0.1:{server.port}/0 needs the cluster key: without it every owner's NIXL "
                "metadata is published in clear and any writer of the directory can forge pages that load; set "
                "HICACHE_L3_KEY_FILE (or HICACHE_L3_KEY) on every instance, or insecure=1 in the URL for a trusted "
                "test setup")  # fmt: skip
        no_password = url.replace(f":{PASSWORD}@", "") + "&insecure_directory=1"
        for refused in (url, url + "&serve=0", no_password):
            with pytest.raises(ValueError) as raised:
                make_storage(refused, make_pool(CASE, pages=4, seed=0), model_id=MODEL)
            assert str(raised.value) == said, refused.replace(PASSWORD, "***")
        monkeypatch.setenv("HICACHE_L3_KEY", os.urandom(32).hex())  # explicit None wins over the environment
        with pytest.raises(ValueError, match="needs the cluster key"):
            make_storage(url, make_pool(CASE, pages=4, seed=0), model_id=MODEL, cluster_key=None)
        assert list(redis.Redis(port=server.port, password=PASSWORD).scan_iter(match=f"{prefix}*")) == []
        assert peer_memory() == before  # no publication area, no staging buffer
        # The control: the key (here from the environment), or insecure=1 without it, binds and publishes.
        for options, key in (("", "from the environment"), ("&insecure=1", None)):
            kw = {} if key else {"cluster_key": None}
            host = make_pool(CASE, pages=4, seed=0)
            store = make_storage(url + options, host, model_id=MODEL, **kw)
            try:
                assert store.authenticated == bool(key)
                assert all(r.ok for r in store.write_pages([f"{i:064x}" for i in range(2)], host.alloc(8)))
            finally:
                store.close()
    finally:
        server.stop()
