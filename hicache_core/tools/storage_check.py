"""``hicache storage check URL`` and ``hicache storage stats URL``."""

from __future__ import annotations

import json
import sys
import uuid
from typing import Any

import torch

from ..plugins.registry import get_registry
from ..pool.host_pool import make_host_pool
from ..storage.backend import PageStatus
from ..storage.keys import page_hashes
from ..storage.make import make_storage
from ..storage.url import StorageURL, redact_url
from ..testing.cases import as_bytes, build_device_pools, fill_random, pages_of


def open_store(url: str, host: Any = None, *, who: str = "hicache storage", **kw: Any) -> tuple[Any, int]:
    """``(store, 0)``: the store of ``url``, reachable; or ``(None, exit status)`` after one line on stderr saying
    why not (never a traceback): 2 for a URL, option or setting it does not take, 1 for a store it cannot reach.

    The store is opened to be looked at (``storage check``, ``storage stats``, ``explain-miss``): a backend that
    declares an ``inspect`` option (``file://``) gets ``inspect=1``, so that it creates nothing (a directory that
    does not exist is refused, not made) and tidies nothing of what it finds.
    """
    try:
        cls = get_registry().storage_backends.get(StorageURL.parse(url).scheme)
        if cls is not None and "inspect" in cls.options_help:
            kw.setdefault("inspect", "1")
        store = make_storage(url, host, **kw)
    except ValueError as exc:  # not a URL, no backend for its scheme, an option or a key setting it refuses
        print(f"{who}: error: cannot open {redact_url(url)}: {_one_line(redact_url(str(exc)))}", file=sys.stderr)
        return None, 2
    except Exception as exc:  # noqa: BLE001 - the store (or its driver) failed to open: say so, no traceback
        print(f"{who}: cannot open {redact_url(url)}: {_one_line(redact_url(str(exc)))}", file=sys.stderr)
        return None, 1
    try:
        store.ping()
    except Exception as exc:  # noqa: BLE001 - StorageError, or a driver's own error: the store is not reachable
        store.close()
        print(f"{who}: {redact_url(url)} is not reachable: {_one_line(redact_url(str(exc)))}", file=sys.stderr)
        return None, 1
    return store, 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _small_pool(page_size: int = 4, pages: int = 16) -> Any:
    # Built from the kit's pure-torch pieces, not its pytest fixtures: the command must run without pytest.
    device_pool, _ = build_device_pools("mha", "plain", page_size, "cpu")
    size = max(pages * page_size, -(-int(device_pool.size) // page_size) * page_size)
    host = make_host_pool(device_pool, layout="page_first", io_backend="reference", operations=[], size=size)
    fill_random(list(host.plan.host_buffers.values()), torch.Generator().manual_seed(int(uuid.uuid4().int % 997)))
    return host


def run_check(url: str, as_json: bool = False) -> int:
    """Write, find, read back and compare a few pages against a live store, then remove them.

    A backend that does not read its own writes (``peer://``: it serves other instances only) is read
    through a second instance of the same URL, bound to a host pool of its own: the round trip a
    peer makes. The backend's own steps (:meth:`StorageBackend.check_steps`) come first.
    """
    host = _small_pool()
    model_id = f"hicache-check-{uuid.uuid4().hex[:12]}"
    who = "hicache storage check"
    store, code = open_store(url, host, who=who, model_id=model_id)
    if store is None:
        return code
    second = not store.backend.capabilities.reads_own_writes
    reader, reader_host = store, host
    if second:
        reader_host = _small_pool()
        reader, code = open_store(url, reader_host, who=who, model_id=model_id)
        if reader is None:
            store.close()
            return code
    via = " (by a second instance)" if second else ""
    steps: list[tuple[str, bool, str]] = []
    p = host.page_size
    keys = page_hashes(list(range(6 * p)), p)
    try:
        steps += store.backend.check_steps()
        src = pages_of(torch.tensor([1, 3, 5, 7, 9, 11]), p)
        dst = pages_of(torch.tensor([2, 4, 6, 8, 10, 12]), p)
        written = store.write_pages(keys[:5], src[: 5 * p])
        steps.append(("write 5 pages", all(r.ok for r in written), _why(written)))
        hits = reader.batch_exists(keys)
        steps.append((f"batch_exists is a prefix length{via}", hits == 5, f"{hits} of 6 (expected 5)"))
        read = reader.read_pages(keys[:5], dst[: 5 * p])
        same = all(
            torch.equal(as_bytes(host.get_data_page(int(src[i * p]))),
                        as_bytes(reader_host.get_data_page(int(dst[i * p]))))
            for i in range(5)
        )  # fmt: skip
        steps.append((f"read back byte-exact{via}", all(r.ok for r in read) and same, _why(read)))
        missing = reader.read_pages(keys[5:], dst[5 * p :])
        steps.append((f"a missing page reads as missing{via}", missing[0].status is PageStatus.MISSING,
                      _why(missing)))  # fmt: skip
        store.backend.remove_objects(store.namespace.keys(keys))
        left = reader.batch_exists(keys)
        steps.append((f"remove{', then found by none' + via if second else ''}", left == 0,
                      f"{left} still found" if left else ""))  # fmt: skip
        stats = store.get_stats().as_dict()
        reader_stats = reader.get_stats().as_dict() if second else None
    except Exception as exc:  # noqa: BLE001 - the store failed mid-check: say so, without a traceback
        print(f"{who} {redact_url(url)}: the store failed: {type(exc).__name__}: "
              f"{_one_line(redact_url(str(exc)))}; {store.backend.server_hint or 'check the store'}",
              file=sys.stderr)  # fmt: skip
        try:  # what the check wrote must not stay behind
            store.backend.remove_objects(store.namespace.keys(keys))
        except Exception:  # noqa: BLE001, S110 - the store is failing already; its error was said above
            pass
        return 1
    finally:
        if second:
            reader.close()
        store.close()
    ok = all(s[1] for s in steps)
    key = store.cluster_key
    # A missing key is the operator's choice, not a fault of the store: a WARN line, not a failed step, so
    # the exit code still says whether the store works (a launcher that requires the key reads "authenticated").
    auth = _auth_warning(key)
    if as_json:
        report = {"url": redact_url(url), "ok": ok, "second_instance": second, "authenticated": key is not None,
                  "key_id": key.key_id.hex() if key is not None else None,
                  "warnings": [auth] if auth else [],
                  "steps": [dict(step=s, ok=o, detail=d) for s, o, d in steps], "stats": stats}  # fmt: skip
        if second:
            report["reader_stats"] = reader_stats
        print(json.dumps(report, indent=2, default=str))
    else:
        print(f"hicache storage check {redact_url(url)} ({type(store.backend).__name__}, {store.backend.capabilities})")
        if second:
            scheme = store.backend.scheme
            print(f"  {scheme}:// serves other instances only: a second instance of the URL reads the pages")
        for step, passed, detail in steps:
            print(f"  {'ok  ' if passed else 'FAIL'} {step}{': ' + detail if detail else ''}")
        if key is not None:
            print(f"  ok   pages authenticated with the cluster key (key id {key.key_id.hex()}, from {key.source})")
        else:
            print(f"  WARN {auth}")
        print("all checks passed" if ok else "some checks FAILED")
    if not ok:
        failed = [s for s in steps if not s[1]]
        print(f"{who} {redact_url(url)}: {len(failed)} check(s) FAILED, first: {failed[0][0]}"
              f"{': ' + _one_line(failed[0][2]) if failed[0][2] else ''}", file=sys.stderr)  # fmt: skip
    return 0 if ok else 1


def _auth_warning(key: Any) -> str | None:
    """What the check says of a store without the cluster key (``None`` with one)."""
    if key is not None:
        return None
    return ("pages UNAUTHENTICATED (no HICACHE_L3_KEY_FILE): whoever can write the store decides what loads; "
            "set HICACHE_L3_KEY_FILE to the cluster's key file on every instance")  # fmt: skip


def run_stats(url: str) -> int:
    """Print the store's own figures (and this process's counters, which start at zero) as JSON."""
    store, code = open_store(url, who="hicache storage stats")
    if store is None:
        return code
    try:
        stats = store.get_stats().as_dict()
    finally:
        store.close()
    if "error" in stats["backend"]:
        stats["backend"]["error"] = redact_url(stats["backend"]["error"])
    print(json.dumps({"url": redact_url(url), "backend_class": type(store.backend).__name__,
                      "capabilities": vars(store.backend.capabilities), **stats}, indent=2, default=str))  # fmt: skip
    if "error" in stats["backend"]:
        print(f"hicache storage stats {redact_url(url)}: the store's figures failed: "
              f"{_one_line(str(stats['backend']['error']))}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _why(results) -> str:
    bad = [r for r in results if not r.ok]
    return "; ".join(f"{r.key[:12]}: {r.status.value} {r.detail}" for r in bad[:3])
