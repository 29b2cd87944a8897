"""Never silently wrong, on Mooncake (real mooncake_master): a missing master, close(), clear(), short objects."""

from __future__ import annotations

import re
import time

import pytest

from hicache_core.storage import PageStatus, StorageError, make_storage, page_hashes
from hicache_core.testing.servers import free_port
from hicache_core.testing.storage_kit import StorageCase, make_pool

CASE = StorageCase("mha", "page_first", "plain", 4)


def test_a_missing_master_fails_within_the_connect_timeout(capsys):
    from mooncake_server import client_problem

    if client_problem():
        pytest.skip(client_problem())
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="no Mooncake master answers.*mooncake_master"):
        make_storage(f"mooncake://127.0.0.1:{free_port()}?connect_timeout=1")
    assert time.monotonic() - t0 < 3
    with pytest.raises(ValueError, match="connect_timeout"):
        make_storage(f"mooncake://127.0.0.1:{free_port()}?connect_timeout=0")


def test_close_clear_and_short_objects(mooncake_url):
    host = make_pool(CASE, pages=16, seed=5)
    mine = make_storage(mooncake_url, host, model_id="a/b")
    other = make_storage(mooncake_url, host, model_id="other")
    keys = page_hashes(list(range(16)), 4)
    assert all(r.ok for r in mine.write_pages(keys, host.alloc(16)))
    assert all(r.ok for r in other.write_pages(keys, host.alloc(16)))
    full = mine.namespace.key(keys[0])
    mine.backend.store.remove(full, True)
    assert mine.backend.store.put(full, b"short") == 0
    res = mine.read_pages(keys, host.alloc(16))
    assert res[0].status is PageStatus.MISMATCH and "5 bytes" in res[0].detail
    assert all(r.ok for r in res[1:])
    mine.clear()  # this namespace only
    assert mine.batch_exists(keys) == 0 and other.batch_exists(keys) == 4
    other.clear()
    mine.close()
    with pytest.raises(StorageError, match="closed"):
        mine.batch_exists(keys)
    other.close()


def test_demo_storage_says_why_a_mooncake_prefix_left_with_its_writer(mooncake_url, capfd):
    """Item 16: process 1's pages live in its own segment and leave with it; the demo says so and how to keep them."""
    from hicache_core.cli import main

    # The master drops a departed client's segment once it has seen the client go; the demo's second process
    # can look the prefix up before that: then it finds the pages but cannot read them, and, rarely (one
    # full-suite run in five here), reads them all. A run that reads them proves nothing about the
    # explanation, so the demo is run again (at most three times).
    outs = []
    for _ in range(3):
        rc = main(["demo", "--storage", mooncake_url, "--device", "cpu", "--tokens", "64"])
        captured = capfd.readouterr()
        outs.append(captured.out + captured.err)  # the processes' reports on stdout, what failed on stderr
        if rc != 0:
            break
    assert rc == 1, f"the prefix outlived its writer in 3 demo runs:\n{outs[-1][-3000:]}"
    out = outs[-1]
    assert "backed up 4 pages (0 failed)" in out  # process 1 wrote the whole prefix
    # ... and it was gone once process 1 exited: not found, or (the master not yet told) found but not readable
    found = re.search(r"found (\d) of 4 pages, prefetched (\d)", out)
    assert found is not None and int(found.group(2)) < 4, out
    assert "the load process failed (exit 1)" in out
    assert "keeps a page in the segment of the client that stored it" in out
    assert "mooncake_client -master_server_address=HOST:PORT" in out
