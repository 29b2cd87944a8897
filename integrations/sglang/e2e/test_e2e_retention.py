"""Pins through SGLang's real server: ``POST /hicache/pin_prefix`` keeps a prompt's pages in hicache's L3.

Two servers of this module (page_first_direct/direct p16 write_through, hicache ``file://`` with a
``capacity`` a few prompts overflow): one as a CPU server runs by default, one as a GPU server runs
(``HICACHE_VERIFY=1``, pages keyed with a cluster key file). Each gets a prompt, whose pages are pinned
(Dynamo's shape: ``token_ids``, ``ttl_seconds``), then a second prompt, not pinned, then enough others to
overflow the store: the pinned prompt's page files are all still there, the second prompt's, more
recent but unpinned, are gone. Unpinned, the first prompt's pages go with the next writes. Bad bodies get
HTTP 400 with what is wrong. The servers run only for this module.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import workload
from conftest import Case, selected
from server import Server, start_all, stop_all
from tiny_model import make_llama

CASE = Case("pfd-direct-p16-wt-pins", "page_first_direct", "direct", 16, "write_through", storage="hicache-file")
#: About 85 pages of the tiny model (12 KiB each on disk): two prompts of 25 pages fit, ten do not.
CAPACITY = 1 << 20
PAGES = workload.PREFIX_TOKENS // CASE.page_size
NAMES = ("pins-default", "pins-verified")


@pytest.fixture(scope="module")
def servers():
    """The two servers, each with a store of its own, started together and stopped after this module."""
    if selected(list(NAMES)) != list(NAMES):
        pytest.skip(f"HICACHE_E2E_ONLY leaves out server(s) {', '.join(NAMES)}")
    root = tempfile.mkdtemp(prefix="hicache-sglang-e2e-pins-")
    log_dir = os.environ.get("HICACHE_E2E_LOG_DIR") or root
    os.makedirs(log_dir, exist_ok=True)
    model = make_llama(os.path.join(root, "tiny-llama"))
    key_file = os.path.join(root, "cluster.key")
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # hicache takes a key only its owner reads
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    env = {"pins-default": {}, "pins-verified": {"HICACHE_VERIFY": "1", "HICACHE_L3_KEY_FILE": key_file}}
    out = {}
    for name in NAMES:
        store = Path(root) / f"{name}.l3"
        out[name] = (Server(name, model, CASE.args(f"file://{store}?capacity={CAPACITY}"), log_dir, env=env[name]),
                     store)  # fmt: skip
    try:
        start_all([srv for srv, _ in out.values()], len(out))
        yield out
    finally:
        stop_all([srv for srv, _ in out.values()])
        shutil.rmtree(root, ignore_errors=True)


def _post(server: Server, path: str, body: object) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.url}{path}", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _files(store: Path) -> set[str]:
    return {p.name for p in store.glob("*/*/*.page")}


def _settled(store: Path, timeout: float = 90.0) -> set[str]:
    """The store's page files once SGLang's backup thread stopped changing them (the set, not the count: a full
    store evicts one page per page written, at the same count)."""
    deadline = time.monotonic() + timeout
    last, since = _files(store), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _files(store)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 3:
            return now
    raise AssertionError(f"{store}: its files still changed after {timeout:.0f} s")


@pytest.mark.parametrize("name", NAMES)
def test_a_pinned_prompt_outlives_newer_prompts_in_a_full_store(servers, name):
    srv, store = servers[name]
    srv.check_up()
    prompts = workload.Prompts.make(seed=11)
    pinned = prompts.first
    unpinned = prompts.fresh_evictors(seed=12)[0]  # another 25 pages, sent after the pinned prompt

    before = _files(store)
    srv.generate(pinned, workload.NEW_TOKENS)
    pinned_files = _settled(store) - before
    assert len(pinned_files) == PAGES, f"the prompt wrote {len(pinned_files)} page files, expected {PAGES}"
    page_bytes = max(os.path.getsize(p) for p in store.glob("*/*/*.page"))
    room = CAPACITY // page_bytes
    assert 2 * PAGES <= room < 10 * PAGES, f"{room} pages of {page_bytes} bytes fit: the test's capacity needs mending"

    status, pin = _post(srv, "/hicache/pin_prefix", {"token_ids": pinned, "ttl_seconds": 600, "session": "agent-a"})
    assert status == 200, pin
    assert (pin["success"], pin["pages"], pin["leased"], pin["protected"], pin["capped"], pin["eviction"]) == \
        (True, PAGES, PAGES, PAGES, 0, ["ordered"]), pin  # fmt: skip
    assert pin["stores"][0]["store"].startswith("file://") and "lease_id" in pin["stores"][0]
    status, pre = _post(srv, "/hicache/prefetch", {"token_ids": pinned})
    assert status == 200 and pre["pages"] == PAGES and isinstance(pre["prefetching"], int), pre

    srv.generate(unpinned, workload.NEW_TOKENS)
    unpinned_files = _settled(store) - before - pinned_files
    assert len(unpinned_files) == PAGES
    for ids in prompts.fresh_evictors(seed=13):  # 8 x 25 more pages: several times what the store holds
        srv.generate(ids, workload.NEW_TOKENS)
    held = _settled(store)
    assert sum(os.path.getsize(p) for p in store.glob("*/*/*.page")) <= CAPACITY
    assert pinned_files <= held, f"{len(pinned_files - held)} of the pinned prompt's {PAGES} pages were evicted"
    assert not unpinned_files & held, f"{len(unpinned_files & held)} pages of the newer, unpinned prompt were kept"

    status, unpin = _post(srv, "/hicache/unpin_prefix", {"session": "agent-a"})
    assert (status, unpin["released"]) == (200, 1), unpin
    for ids in prompts.fresh_evictors(seed=14)[:2]:  # 50 pages: the oldest ordinary pages now are the prompt's
        srv.generate(ids, workload.NEW_TOKENS)
    assert not pinned_files & _settled(store), "unpinned, the prompt's pages should have gone first"

    if name == "pins-verified":  # written as a GPU server writes them: keyed, with their checksum rows
        from hicache_core.storage.page_format import HEADER_SIZE, unpack_header

        with open(next(store.glob("*/*/*.page")), "rb") as f:
            header = unpack_header(f.read(HEADER_SIZE))
        assert header.keyed and header.verify_words > 0, header


BAD = [
    ("/hicache/pin_prefix", {"token_ids": [5] * 32, "ttl_seconds": -1},
     "a time to live must be a finite number of seconds > 0, got -1"),
    ("/hicache/pin_prefix", {"token_ids": [5] * 32, "ttl_seconds": 60, "priority": 101},
     "a lease's priority is 0..100, got 101"),
    ("/hicache/pin_prefix", {"token_ids": [5, 6], "ttl_seconds": 60}, "token_ids hold 2 tokens: no whole page of 16"),
    ("/hicache/unpin_prefix", {"token_ids": [5], "session": "s"}, '"token_ids" (the pins of a prefix), one of them'),
    ("/hicache/prefetch", b"{not json", "the body is not JSON"),
    ("/hicache/prefetch", b"", "the body is empty: POST a JSON object"),
]  # fmt: skip


def test_a_malformed_body_gets_400_with_what_is_wrong(servers):
    srv, _ = servers["pins-default"]
    srv.check_up()
    for path, body, message in BAD:
        status, answer = _post(srv, path, body)
        assert status == 400 and answer["success"] is False and message in answer["message"], (path, body, answer)
    status, _ = _post(srv, "/hicache/pin_prefix", {"token_ids": [5] * 16, "ttl_seconds": 60})
    assert status == 200  # the server serves on after the refusals
