"""What Mooncake's transfer engine exposes of this process, probed as an outsider would (a real mooncake_master).

The transfer engine answers anyone who reaches its TCP port (it listens on every interface) and reads or
writes any address inside a buffer its client registered. So the test speaks the engine's wire format to
the port itself: by default the host pool is out of reach (only the staging buffers pages pass through are
registered); with ``expose_host_pool=1`` the same request reads a page of the pool, which shows the probe
is not vacuous.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import time
import uuid

import pytest
import torch

from hicache_core.storage import make_storage, page_hashes
from hicache_core.storage.page_format import HEADER_SIZE
from hicache_core.testing.storage_kit import StorageCase, make_pool, page_bytes, slots_of

CASE = StorageCase("mha", "page_first", "plain", 4)
READ, WRITE = 0, 1  # Mooncake's TransferRequest::OpCode


def _listening_ports() -> list[int]:
    """The TCP ports this process listens on (Mooncake's handshake and transfer ports among them)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:  # LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _engine(port: int, address: int, nbytes: int, write: bytes | None = None) -> bytes:
    """One request to a transfer engine's TCP port, as any peer may send it: what came back (b"" if refused)."""
    header = struct.pack("<QQB7x", nbytes, address, WRITE if write is not None else READ)
    got = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(header + (write or b""))
            while len(got) < nbytes:
                chunk = conn.recv(nbytes - len(got))
                if not chunk:
                    break
                got += chunk
    except OSError:
        pass
    return got


def _transfer_port(backend) -> int:
    """The port of this backend's transfer engine: the one that reads back a marker registered through it."""
    marker = torch.frombuffer(bytearray(b"hicache-probe-marker" * 4), dtype=torch.uint8).clone()
    backend._client.register(marker.data_ptr(), marker.numel())
    try:
        want = bytes(marker[:20].numpy())
        for port in _listening_ports():
            if _engine(port, marker.data_ptr(), 20) == want:
                return port
    finally:
        backend._client.unregister(marker.data_ptr())
    pytest.fail("no port of this process answered as Mooncake's TCP transfer engine")


def test_the_transfer_port_reaches_staging_and_never_the_host_pool(mooncake_url):
    host = make_pool(CASE, pages=16, seed=3)
    store = make_storage(mooncake_url, host, model_id=f"expose-{uuid.uuid4().hex[:8]}")
    keys = page_hashes(list(range(8 * 4)), 4)
    assert all(r.ok for r in store.write_pages(keys, slots_of(list(range(8)), 4)))
    assert all(r.ok for r in store.read_pages(keys, slots_of(list(range(8, 16)), 4)))
    port = _transfer_port(store.backend)
    page = store.pages.page_spans(3)[0]
    before = ctypes.string_at(page.ptr, 64)

    assert _engine(port, page.ptr, 64) == b"", "an outsider read the host pool through the transfer engine"
    _engine(port, page.ptr, 16, write=b"X" * 16)
    time.sleep(0.2)
    assert ctypes.string_at(page.ptr, 64) == before, "an outsider wrote the host pool through the transfer engine"
    stats = store.backend.backend_stats()
    assert not stats["host_pool_registered"]
    pool = [(s.ptr, s.ptr + s.nbytes) for s in store.pages.buffer_spans()]
    for ptr, nbytes in store.backend._registered:  # what is registered is staging, outside every pool buffer
        assert all(ptr + nbytes <= lo or ptr >= hi for lo, hi in pool)
    # Staging is reachable (pages in transit are as readable as the store itself): the probe works there.
    staging, nbytes = store.backend._registered[0]
    assert _engine(port, staging, 64) == ctypes.string_at(staging, 64)

    exposed = make_storage(mooncake_url + "&expose_host_pool=1", host, model_id=f"exposed-{uuid.uuid4().hex[:8]}")
    try:
        assert exposed.backend._client is store.backend._client  # the same client: the same transfer port
        assert exposed.backend.backend_stats()["host_pool_registered"]
        assert _engine(port, page.ptr, 64) == before, "expose_host_pool=1 registers the pool: the probe reads it"
    finally:
        exposed.close()
    assert _engine(port, page.ptr, 64) == b"", "closing the exposing store unregisters the pool"
    store.close()


def test_pages_round_trip_byte_exact_through_staging_smaller_than_a_batch(mooncake_url, monkeypatch):
    """Verifying pool, cluster key: staging of one page (the option's floor) moves a batch one page per call."""
    monkeypatch.setenv("HICACHE_VERIFY", "1")
    monkeypatch.delenv("HICACHE_L3_KEY_FILE", raising=False)  # scripts/dev tiers sets the key as a file
    monkeypatch.setenv("HICACHE_L3_KEY", "5e" * 32)
    host = make_pool(CASE, pages=24, seed=9)
    store = make_storage(mooncake_url + "&staging=1", host, model_id=f"staged-{uuid.uuid4().hex[:8]}")
    assert store.authenticated and store.backend.trailer_bytes > 0
    keys = page_hashes(list(range(12 * 4)), 4)
    originals = [page_bytes(host, p) for p in range(12)]
    assert all(r.ok for r in store.write_pages(keys, slots_of(list(range(12)), 4)))
    results = store.read_pages(keys, slots_of(list(range(12, 24)), 4))
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    for p, original in enumerate(originals):
        assert torch.equal(page_bytes(host, 12 + p), original), f"page {p} did not come back byte for byte"
    # One thread moved the pages: one staging buffer, of one page's object.
    assert [n for _, n in store.backend._registered] == [HEADER_SIZE + store.page_bytes + store.backend.trailer_bytes]
    store.close()
