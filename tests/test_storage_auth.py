"""L3 pages authenticated with the cluster's key, against the real stores (file, redis-server, SeaweedFS, Mooncake).

The trusted instances hold the key; the outsider does not, but reads and writes the store with the
store's own client (here: a page store made without a key, calling the plugin's primitives, the
bytes an outsider with the store's address and password would move). Whatever the outsider writes,
copies or changes, an instance with the key misses with ``auth_failed`` and never loads it; pages
the key wrote load byte-exact. Without a key, behaviour is today's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pickle
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache_core import metrics
from hicache_core.cli import main
from hicache_core.plugins.registry import get_registry
from hicache_core.storage import StorageController, make_storage, page_hashes
from hicache_core.storage.backend import PageStatus
from hicache_core.storage.explain import explain_miss
from hicache_core.storage.page_auth import ClusterKey, ClusterKeyError
from hicache_core.storage.page_format import CHECKSUM_KEYED, HEADER_SIZE, address_of, checksum_bytes, unpack_header
from hicache_core.storage.pages import Span
from hicache_core.testing import explain_kit as kit
from hicache_core.testing.servers import start_redis

ROOT = Path(__file__).resolve().parents[1]
KEY_A = b"planted-cluster-key-A-0123456789abcdef"  # planted: never shown anywhere
KEY_B = b"planted-cluster-key-B-fedcba9876543210"


def _helper(plugin: str, module: str):
    path = ROOT / "plugins" / plugin / "tests" / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"_auth_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _store(scheme: str, tmp_path: Path) -> Iterator[str]:
    """A live store of ``scheme`` (a real server where it has one); yields its URL."""
    if scheme not in get_registry().storage_backends:
        pytest.skip(f"no installed plugin registers {scheme}://")
    if scheme == "file":
        yield f"file://{tmp_path / 'l3'}"
    elif scheme == "redis":
        server = start_redis(tmp_path, "--requirepass", "planted-redis-pw")
        try:
            yield f"redis://:planted-redis-pw@127.0.0.1:{server.port}/0?prefix=auth:"
        finally:
            server.stop()
    elif scheme == "s3":
        weed = _helper("storage-s3", "seaweedfs_server")
        server = weed.start_seaweedfs(tmp_path / "weed")
        try:
            yield server.url(server.create_bucket("auth"), "p", key_id=weed.ACCESS_KEY, secret=weed.SECRET_KEY)
        finally:
            server.stop()
    elif scheme == "mooncake":
        master = _helper("storage-mooncake", "mooncake_server").start_master(tmp_path)
        try:
            yield f"mooncake://127.0.0.1:{master.port}?segment=64MiB&local_buffer=16MiB"
        finally:
            master.stop()


def _fill(host, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in host.plan.host_buffers.values():
        flat = t.reshape(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))


def _page(store, page: int) -> bytes:
    return b"".join(bytes(s.view) for s in store.pages.page_spans(page))


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * kit.PAGE + torch.arange(kit.PAGE)).reshape(-1)


def _spans(blob: bytearray) -> list[Span]:
    """An object's spans as the page store gives them: the header, then the page (a backend may store them apart)."""
    base, view = address_of(blob), memoryview(blob)
    return [Span(base, HEADER_SIZE, view[:HEADER_SIZE]), Span(base + HEADER_SIZE, len(blob) - HEADER_SIZE,
                                                               view[HEADER_SIZE:])]  # fmt: skip


def _raw_read(store, full_key: str) -> bytearray:
    """The object's bytes, as the store's client hands them to anyone who can read the store."""
    blob = bytearray(HEADER_SIZE + store.page_bytes)
    backend = store.backend
    if backend.capabilities.zero_copy:
        (err,) = backend.get_objects_into([full_key], [_spans(blob)])
        assert err is None, err
    else:
        (got,) = backend.get_objects([full_key])
        assert isinstance(got, (bytes, bytearray, memoryview)), got
        blob[:] = bytes(got)
    return blob


def _raw_write(store, full_key: str, blob: bytearray) -> None:
    """Put bytes under a key with the store's client, as anyone who can write the store can."""
    store.backend.remove_objects([full_key])  # a store that keeps the first put (Mooncake) takes the second
    (err,) = store.backend.put_objects([full_key], [_spans(blob)])
    assert err is None, err


def _auth_failures() -> dict[str, float]:
    rows = metrics.snapshot()["hicache_l3_auth_failures_total"]["values"]
    return {r["labels"]["why"]: r["value"] for r in rows}


@pytest.mark.parametrize("scheme", ["file", "redis", "s3", "mooncake"])
def test_only_pages_the_key_wrote_load(scheme, tmp_path):
    key_a, key_b = ClusterKey(KEY_A, "test A"), ClusterKey(KEY_B, "test B")
    with _store(scheme, tmp_path) as url:
        model = f"auth/{scheme}"
        src, dst = kit.host_pool(pages=16), kit.host_pool(pages=16)
        _fill(src, 1)
        writer = make_storage(url, src, model_id=model, cluster_key=key_a)
        reader = make_storage(url, dst, model_id=model, cluster_key=key_a)  # another instance of the cluster
        other = make_storage(url, dst, model_id=model, cluster_key=key_b)  # another cluster
        keyless = make_storage(url, src, model_id=model, cluster_key=None)  # an instance without a key
        outsider = make_storage(url, src, model_id=model, cluster_key=None)  # store access, no key
        try:
            assert writer.authenticated and not keyless.authenticated
            keys = page_hashes(list(range(8 * kit.PAGE)), kit.PAGE)
            ns = writer.namespace
            metrics.reset()
            assert [r.status for r in writer.write_pages(keys[:4], _slots([0, 1, 2, 3]))] == [PageStatus.OK] * 4
            header = unpack_header(_raw_read(outsider, ns.key(keys[0]))[:HEADER_SIZE])
            assert header.checksum_algorithm == CHECKSUM_KEYED and header.key_id == key_a.key_id

            # the cluster reads them back, byte-exact
            results = reader.read_pages(keys[:4], _slots([4, 5, 6, 7]))
            assert [r.status for r in results] == [PageStatus.OK] * 4, results
            assert [_page(reader, p) for p in (4, 5, 6, 7)] == [_page(writer, p) for p in (0, 1, 2, 3)]

            # another key, or none, cannot authenticate them
            (r,) = other.read_pages(keys[:1], _slots([8]))
            ids = f"id {key_a.key_id.hex()}, this instance's is {key_b.key_id.hex()}"
            assert (r.status, r.detail) == (PageStatus.AUTH_FAILED, f"written with another cluster key ({ids})")
            (r,) = keyless.read_pages(keys[:1], _slots([8]))
            assert r.status is PageStatus.AUTH_FAILED and "this instance has no key" in r.detail, r

            # a page an instance without the key wrote is not loaded by the cluster
            assert keyless.write_pages(keys[4:5], _slots([4]))[0].ok
            (r,) = reader.read_pages(keys[4:5], _slots([9]))
            assert r.status is PageStatus.AUTH_FAILED and r.detail.startswith("written without the cluster key"), r

            # the outsider changes one payload byte of a page
            blob = _raw_read(outsider, ns.key(keys[1]))
            blob[HEADER_SIZE + 100] ^= 0x01
            _raw_write(outsider, ns.key(keys[1]), blob)
            # ... claims another key id for a page (mending the header CRC: it is no secret)
            blob = _raw_read(outsider, ns.key(keys[2]))
            blob[20] ^= 0xFF  # the key id: claims another key
            blob[HEADER_SIZE - 4 : HEADER_SIZE] = struct.pack("<I", zlib.crc32(bytes(blob[: HEADER_SIZE - 4])))
            _raw_write(outsider, ns.key(keys[2]), blob)
            # ... and copies a sound page of the cluster under another page's key
            _raw_write(outsider, ns.key(keys[5]), _raw_read(outsider, ns.key(keys[3])))
            before = _page(reader, 10) if not reader.backend.capabilities.zero_copy else None
            results = reader.read_pages([keys[1], keys[2], keys[5]], _slots([10, 11, 12]))
            assert [r.status for r in results] == [PageStatus.AUTH_FAILED] * 3, results
            assert results[0].detail.startswith("MAC mismatch: the bytes were changed"), results[0]
            assert results[1].detail.startswith("written with another cluster key"), results[1]
            assert results[2].detail.startswith("MAC mismatch"), results[2]
            if before is not None:  # without zero-copy a page reaches the pool only once it authenticated
                assert _page(reader, 10) == before
            # the page copied is still sound under its own key
            assert reader.read_pages(keys[3:4], _slots([13]))[0].ok and _page(reader, 13) == _page(writer, 3)

            assert reader.get_stats().read_auth_failed == 4
            assert _auth_failures() == {"other_key": 2, "no_key_here": 1, "unkeyed": 1, "bad_tag": 2}
            rows = metrics.snapshot()["hicache_l3_pages_total"]["values"]
            assert {"labels": {"op": "read", "outcome": "auth_failed"}, "value": 6} in rows
        finally:
            for s in (writer, reader, other, keyless, outsider):
                s.close()


@pytest.mark.parametrize("scheme", ["file", "redis"])
def test_a_forged_prefix_is_an_auth_failed_miss_for_the_controller_and_explain_miss(scheme, tmp_path, monkeypatch,
                                                                                       capsys):  # fmt: skip
    monkeypatch.delenv("HICACHE_L3_KEY_FILE", raising=False)
    monkeypatch.setenv("HICACHE_L3_KEY", KEY_A.decode())
    with _store(scheme, tmp_path) as url:
        model = f"auth-explain/{scheme}"
        host = kit.host_pool(pages=16)
        _fill(host, 2)
        cluster = make_storage(url, host, model_id=model)  # the key from the environment
        outsider = make_storage(url, host, model_id=model, cluster_key=None)
        toks = list(range(5000, 5000 + 4 * kit.PAGE))
        keys = page_hashes(toks, kit.PAGE)
        try:
            assert cluster.authenticated
            assert [r.ok for r in outsider.write_pages(keys[2:4], _slots([2, 3]))] == [True, True]
            with StorageController(cluster, prefetch_policy="wait_complete") as ctl:
                ctl.backup(toks[: 2 * kit.PAGE], host.alloc(2 * kit.PAGE)).result(30)
                result = ctl.prefetch(toks).result(30)
                assert result.completed == 2, result  # the outsider's pages were read, and not loaded
                assert ctl.outcomes.last(keys[2])[:2] == ("auth_failed", "written without the cluster key (by a "
                                                          "writer outside the cluster, or by an instance without "
                                                          "HICACHE_L3_KEY_FILE)")  # fmt: skip
                assert ctl.outcomes.last(keys[3])[0] == "earlier_page_failed"
                assert ctl.stats()["prefetch_pages_loaded"] == 2
            report = explain_miss(cluster, toks)
            assert [p.reason for p in report.pages] == ["in_store", "in_store", "auth_failed", "auth_failed"]
            assert report.pages[2].detail.startswith("written without the cluster key")
            # the command line: the key from the environment, the same answer
            code = main(["explain-miss", url, "--model-id", model, *kit.CLI_GEOMETRY, "--token-ids",
                         ",".join(map(str, toks)), "--json"])  # fmt: skip
            out = capsys.readouterr().out
            assert code == 1 and [p["reason"] for p in json.loads(out)["pages"]][2] == "auth_failed", out
            assert KEY_A.decode() not in out
        finally:
            cluster.close()
            outsider.close()


def test_without_a_key_pages_are_written_as_before(tmp_path, monkeypatch):
    for var in ("HICACHE_L3_KEY", "HICACHE_L3_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    host = kit.host_pool(pages=4)
    _fill(host, 3)
    store = make_storage(f"file://{tmp_path}", host, model_id="plain")
    try:
        assert not store.authenticated and "unauthenticated" in repr(store)
        keys = page_hashes(list(range(kit.PAGE)), kit.PAGE)
        assert store.write_pages(keys, _slots([0]))[0].ok
        header = unpack_header(_raw_read(store, store.namespace.key(keys[0]))[:HEADER_SIZE])
        assert header.checksum_algorithm == 1 and header.checksum == checksum_bytes(_page(store, 0))
        assert store.read_pages(keys, _slots([1]))[0].ok and _page(store, 1) == _page(store, 0)
    finally:
        store.close()


# ---- the key's configuration ----------------------------------------------------------------------------


def test_the_key_comes_from_a_file_or_the_environment(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(KEY_A + b"\n")
    path.chmod(0o600)
    from_file = ClusterKey.from_environment({"HICACHE_L3_KEY_FILE": str(path)})
    from_env = ClusterKey.from_environment({"HICACHE_L3_KEY": KEY_A.decode()})
    assert from_file == from_env and from_file.key_id == from_env.key_id == ClusterKey(KEY_A).key_id
    assert from_file.source == str(path) and from_env.source == "HICACHE_L3_KEY"
    assert ClusterKey(KEY_B).key_id != from_file.key_id and len(from_file.key_id) == 8
    assert ClusterKey.from_environment({}) is None and ClusterKey.from_environment({"HICACHE_L3_KEY": "  "}) is None


@pytest.mark.parametrize("environ, message", [
    ({"HICACHE_L3_KEY": "planted-short"}, "the cluster key from HICACHE_L3_KEY is 13 bytes; it must be at least 32"),
    ({"HICACHE_L3_KEY": KEY_A.decode(), "HICACHE_L3_KEY_FILE": "/x"},
     "both HICACHE_L3_KEY_FILE and HICACHE_L3_KEY are set: set one"),
    ({"HICACHE_L3_KEY_FILE": "{tmp}/absent"}, "cannot read the cluster key file {tmp}/absent (HICACHE_L3_KEY_FILE): "
                                              "No such file or directory"),
    ({"HICACHE_L3_KEY_FILE": "{tmp}/open"}, "cluster key file {tmp}/open may be read or written by any user "
                                            "(mode -rw-r--r--): chmod o-rwx {tmp}/open"),
    ({"HICACHE_L3_KEY_FILE": "{tmp}"}, "cannot read the cluster key file {tmp} (HICACHE_L3_KEY_FILE): Is a directory"),
])  # fmt: skip
def test_a_bad_key_setting_is_refused_before_any_byte_moves_and_never_shown(environ, message, tmp_path, monkeypatch):
    (tmp_path / "open").write_bytes(KEY_A)
    (tmp_path / "open").chmod(0o644)
    for var in ("HICACHE_L3_KEY", "HICACHE_L3_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in environ.items():
        monkeypatch.setenv(var, value.replace("{tmp}", str(tmp_path)))
    message = message.replace("{tmp}", str(tmp_path))
    store_dir = tmp_path / "never-made"
    with pytest.raises(ClusterKeyError) as raised:
        make_storage(f"file://{store_dir}", kit.host_pool(pages=2), model_id="m")
    assert str(raised.value).startswith(message), str(raised.value)
    assert not store_dir.exists()  # refused before the backend was opened
    text = str(raised.value) + repr(raised.value)
    assert "planted" not in text and KEY_A.decode() not in text


def test_the_key_never_shows(tmp_path):
    key = ClusterKey(KEY_A, "HICACHE_L3_KEY")
    host = kit.host_pool(pages=2)
    store = make_storage(f"file://{tmp_path}", host, model_id="m", cluster_key=key)
    try:
        texts = [repr(key), str(key), repr(store), json.dumps(store.get_stats().as_dict(), default=str),
                 repr(vars(store.backend)), repr(key.__slots__)]  # fmt: skip
        with pytest.raises(TypeError, match="not pickled"):
            pickle.dumps(key)
        with pytest.raises(TypeError, match="never its bytes") as raised:
            make_storage(f"file://{tmp_path}", host, model_id="m", cluster_key=KEY_A.decode())
        texts.append(str(raised.value))
        for text in texts:
            assert "planted" not in text and KEY_A.hex() not in text, text
        assert f"key id={key.key_id.hex()}" in repr(store)
    finally:
        store.close()


def test_a_verifying_pools_pages_and_flat_pages_under_the_key():
    """A verifying pool's pages carry their checksum row: the tag covers it, and the host authenticates the
    payload too (a device checksum is no MAC); a flat ``get`` and a flat ``set`` work under the key."""
    from core_helpers import device_pool, fill_random

    import hicache_core as hc

    dp = device_pool("mha", 4, pages=6)
    fill_random([t for c in hc.pool.host_pool.pool_kind_of(dp).components for t in getattr(dp, c.device_attr)], seed=5)
    host = hc.make_host_pool(dp, layout="page_first", io_backend="auto", verify=True)
    slots = host.alloc(8)
    host.backup_from_device_all_layer(dp, slots, torch.arange(4, 12), "auto")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    store = make_storage(f"memory://auth-verify-{os.getpid()}", host, model_id="v", cluster_key=ClusterKey(KEY_A))
    try:
        assert not store.device_checked and store.pages.trailer_bytes
        keys = page_hashes(list(range(8)), 4)
        assert all(r.ok for r in store.write_pages(keys, slots))
        (full,) = store.namespace.keys(keys[:1])
        (blob,) = store.backend.get_objects([full])
        header = unpack_header(bytes(blob[:HEADER_SIZE]))
        assert header.keyed and header.verify_words == store.pages.trailer_bytes // 8
        flat = store.get(keys[1])
        first = int(slots[4]) // 4
        assert flat is not None and bytes(flat.reshape(-1).view(torch.uint8).numpy()) == _page(store, first)
        assert store.set("flat", flat) and torch.equal(store.get("flat"), flat)
        # one byte of the checksum row changed: the tag covers the row
        changed = bytearray(blob)
        changed[HEADER_SIZE + store.page_bytes + 3] ^= 1
        store.backend.put_objects([full], [_spans(changed)])
        (r,) = store.read_pages(keys[:1], host.alloc(4))
        assert r.status is PageStatus.AUTH_FAILED and r.detail.startswith("MAC mismatch"), r
    finally:
        store.close()


def test_a_key_file_only_its_owner_reads_is_taken(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(os.urandom(16).hex().encode() + b"\n")  # 32 hex characters: the least taken
    path.chmod(0o640)
    assert len(ClusterKey.from_file(path).key_id) == 8
    path.write_bytes(b"k" * (1 << 16) + b"k")  # not truncated to a key: refused
    with pytest.raises(ClusterKeyError, match=f"^cluster key file {path} is over 65536 bytes: not a key file$"):
        ClusterKey.from_file(path)


def test_a_peer_reader_authenticates_what_it_reads_from_an_owner(tmp_path, monkeypatch):
    """``peer://``: the page's tag travels in the directory entry, which carries a tag of its own, and covers the
    bytes read from the owner's publication area: an unkeyed publisher's entry is ignored (a miss), and bytes
    changed in the area after publishing (what a remote NIXL write could do) are ``auth_failed``."""
    pytest.importorskip("nixl_cu13", reason="NIXL is not installed (pip install nixl-cu13==1.5.1)")
    if "peer" not in get_registry().storage_backends:
        pytest.skip("hicache-storage-peer is not installed")
    monkeypatch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "tcp,self"))
    server = start_redis(tmp_path)
    url = f"peer://127.0.0.1:{server.port}/0?prefix=auth:&timeout=5&insecure_directory=1&publish_bytes=4MiB"
    owner_pool, reader_pool = kit.host_pool(pages=8), kit.host_pool(pages=8)
    _fill(owner_pool, 4)
    key = ClusterKey(KEY_A)
    stores = []
    try:
        owner = make_storage(url, owner_pool, model_id="peer-auth", cluster_key=key)
        stores.append(owner)
        keyless_owner = make_storage(url + "&insecure=1", owner_pool, model_id="peer-auth", cluster_key=None)
        stores.append(keyless_owner)
        reader = make_storage(url, reader_pool, model_id="peer-auth", cluster_key=key)
        stores.append(reader)
        keys = page_hashes(list(range(4 * kit.PAGE)), kit.PAGE)
        assert all(r.ok for r in owner.write_pages(keys[:2], _slots([0, 1])))
        assert keyless_owner.write_pages(keys[2:3], _slots([2]))[0].ok
        results = reader.read_pages(keys[:3], _slots([4, 5, 6]))
        assert [r.status for r in results] == [PageStatus.OK, PageStatus.OK, PageStatus.MISSING], results
        assert reader.get_stats().backend["bad_owner_records"] == 1  # the unkeyed owner's record, ignored
        assert _page(reader, 4) == _page(owner, 0) and _page(reader, 5) == _page(owner, 1)
        # a byte of a published page changed in the owner's publication area (what a remote NIXL write could do)
        area = owner.backend._area
        area[owner.backend._slot_of[owner.namespace.keys(keys[1:2])[0]] * owner.backend.slot_bytes + 7] ^= 0x01
        (r,) = reader.read_pages(keys[1:2], _slots([7]))
        assert r.status is PageStatus.AUTH_FAILED and r.detail.startswith("MAC mismatch"), r
    finally:
        for s in stores:
            s.close()
        server.stop()


def test_storage_check_says_whether_pages_are_authenticated(tmp_path, monkeypatch, capsys):
    for var in ("HICACHE_L3_KEY", "HICACHE_L3_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    url = f"file://{tmp_path}"
    assert main(["storage", "check", url]) == 0
    assert "WARN pages UNAUTHENTICATED (no HICACHE_L3_KEY_FILE): whoever can write the store" in capsys.readouterr().out
    monkeypatch.setenv("HICACHE_L3_KEY", KEY_A.decode())
    assert main(["storage", "check", url]) == 0
    out = capsys.readouterr().out
    key_id = ClusterKey(KEY_A).key_id.hex()
    assert f"pages authenticated with the cluster key (key id {key_id}, from HICACHE_L3_KEY)" in out, out
    assert main(["storage", "check", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["ok"], report["authenticated"], report["key_id"]) == (True, True, key_id)
    monkeypatch.setenv("HICACHE_L3_KEY", "planted-short")
    assert main(["storage", "check", url]) == 2  # a setting the store does not take: bad usage, on stderr
    out, err = capsys.readouterr()
    assert out == "" and "is 13 bytes; it must be at least 32" in err and "planted" not in err, err


def test_record_tags_and_sealed_records_bind_their_kind_fields_and_key():
    """Directory records (``peer://``): a tag checks only for the same kind, the same fields split the same way,
    under the same key, and is never a page tag; a sealed record opens only with the same kind, bound fields and
    key, and hides what it holds."""
    a, b = ClusterKey(KEY_A), ClusterKey(KEY_B)
    tag = a.record_tag("peer entry", "prefix:", "model/abc", "owner-1", b"\x01\x02")
    assert len(tag) == 32 and tag == a.record_tag("peer entry", "prefix:", "model/abc", "owner-1", b"\x01\x02")
    others = [
        a.record_tag("peer owner", "prefix:", "model/abc", "owner-1", b"\x01\x02"),  # another kind
        a.record_tag("peer entry", "prefix:", "model/abd", "owner-1", b"\x01\x02"),  # another page key
        a.record_tag("peer entry", "prefix:", "model/abc", "owner-2", b"\x01\x02"),  # another owner
        a.record_tag("peer entry", "prefix:", "model/ab", "cowner-1", b"\x01\x02"),  # another split
        b.record_tag("peer entry", "prefix:", "model/abc", "owner-1", b"\x01\x02"),  # another key
    ]
    for other in others:
        assert not a.verify(other, tag)
    assert a.tag(b"", "model/abc", []) != a.record_tag("peer entry", "model/abc")  # the page MAC's key is another
    pytest.importorskip("cryptography", reason="sealed records need the cryptography package")
    secret = b"nixl metadata: worker address, rkeys" * 4
    sealed = a.seal("peer owner metadata", secret, "prefix:", "owner-1")
    assert secret not in sealed and sealed != a.seal("peer owner metadata", secret, "prefix:", "owner-1")  # a nonce
    assert a.open("peer owner metadata", sealed, "prefix:", "owner-1") == secret
    assert a.open("peer owner metadata", sealed, "prefix:", "owner-2") is None  # copied to another owner
    assert a.open("peer entry", sealed, "prefix:", "owner-1") is None
    assert b.open("peer owner metadata", sealed, "prefix:", "owner-1") is None
    changed = bytearray(sealed)
    changed[20] ^= 1
    assert a.open("peer owner metadata", bytes(changed), "prefix:", "owner-1") is None
    assert a.open("peer owner metadata", b"short", "prefix:", "owner-1") is None
