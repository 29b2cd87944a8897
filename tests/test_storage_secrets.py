"""No credential in any message, log, repr, exception, metric label or CLI output, for every storage scheme.

Each registered storage scheme has one row in :data:`STORES`: a context manager that starts its store
(a real server where it needs one) and yields URLs with a secret planted in them (user-info password,
``password=``/``secret=`` options): some that work, some that fail (bad address, wrong password,
unreachable, unknown option). Every URL goes through ``make_storage``, the page contract, the stats,
``hicache storage check|stats`` and a controller's backup and prefetch; every text that comes out is
scanned for the secrets. A plugin that registers a new scheme adds one row (the first test says so).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hicache_core import cli, metrics
from hicache_core.plugins.registry import get_registry
from hicache_core.storage import StorageBackend, make_storage
from hicache_core.storage.backend import Capabilities, StorageError
from hicache_core.storage.keys import page_hashes
from hicache_core.storage.url import redact_text, redact_url, scrub_exception
from hicache_core.testing.servers import free_port, start_redis
from hicache_core.testing.storage_kit import StorageCase, make_pool, slots_of

SECRET = "Pl4nted-pw-7f3e"  # in user-info
OPTION_SECRET = "Pl4nted-opt-91c2"  # in ?password= / ?secret= options
WRONG = "Pl4nted-wrong-55aa"  # a wrong password, which must not show either
SECRETS = (SECRET, OPTION_SECRET, WRONG)
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    """One scheme's URLs: ``working`` ones open a live store, ``failing`` ones must fail (without a secret)."""

    working: list[str] = field(default_factory=list)
    failing: list[str] = field(default_factory=list)
    #: Secrets of the row's own server (a fixed test credential), scanned for as the planted ones are.
    secrets: tuple[str, ...] = ()
    #: What writing 2 pages, then reading them and a third, gives on a working URL. A peer tier serves
    #: other instances, never its own pool: its own pages read back as misses.
    expect: tuple[str, ...] = ("ok", "ok", "ok", "ok", "missing")


def _helper(plugin: str, module: str):
    """A plugin's test helper (its server starter), loaded from its tests folder."""
    path = ROOT / "plugins" / plugin / "tests" / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"_secrets_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _file_store(tmp_path: Path) -> Iterator[Row]:
    root = tmp_path / "l3"
    yield Row(
        working=[f"file://{root}"],
        failing=[f"file://me:{SECRET}@{root}", f"file://me:{SECRET}@otherhost{root}",
                 f"file://{root}?secret={OPTION_SECRET}", f"file://{root}?password={OPTION_SECRET}&capacity=x"],
    )  # fmt: skip


@contextlib.contextmanager
def _redis_store(tmp_path: Path) -> Iterator[Row]:
    server = start_redis(tmp_path, "--requirepass", SECRET)
    try:
        port = server.port
        yield Row(
            working=[f"redis://default:{SECRET}@127.0.0.1:{port}/0?prefix=s1:",
                     f"redis://127.0.0.1:{port}/0?password={SECRET}&prefix=s2:"],
            failing=[f"redis://:{WRONG}@127.0.0.1:{port}/0", f"redis://u:{WRONG}@127.0.0.1:{free_port()}/0?timeout=1",
                     f"redis://:{SECRET}@127.0.0.1:{port}/notadb", f"redis://:{SECRET}@127.0.0.1:{port}/0?secret={OPTION_SECRET}",
                     f"redis://:{SECRET}@127.0.0.1:99999/0", f"redis://127.0.0.1:{port}/0?password={WRONG}&timeout=-1"],
        )  # fmt: skip
    finally:
        server.stop()


@contextlib.contextmanager
def _mooncake_store(tmp_path: Path) -> Iterator[Row]:
    master = _helper("storage-mooncake", "mooncake_server").start_master(tmp_path)
    try:
        port, small = master.port, "segment=64MiB&local_buffer=16MiB"
        yield Row(
            working=[f"mooncake://127.0.0.1:{port}?{small}"],
            failing=[f"mooncake://admin:{SECRET}@/?{small}",  # the address error that once repeated the URL
                     f"mooncake://admin:{SECRET}@127.0.0.1:{port}?{small}",
                     f"mooncake://127.0.0.1:{port}?{small}&password={OPTION_SECRET}",
                     f"mooncake://admin:{SECRET}@127.0.0.1:{free_port()}?connect_timeout=0.3"],
        )  # fmt: skip
    finally:
        master.stop()


@contextlib.contextmanager
def _memory_store(tmp_path: Path) -> Iterator[Row]:
    name = f"secrets-{tmp_path.name}"
    yield Row(working=[f"memory://{name}"],
              failing=[f"memory://me:{SECRET}@{name}", f"memory://{name}?secret={OPTION_SECRET}",
                       f"memory://{name}?capacity=x&password={OPTION_SECRET}"])  # fmt: skip


@contextlib.contextmanager
def _s3_store(tmp_path: Path) -> Iterator[Row]:
    weed = _helper("storage-s3", "seaweedfs_server")
    server = weed.start_seaweedfs(tmp_path / "weed")
    try:
        bucket = server.create_bucket("secrets")
        yield Row(
            working=[server.url(bucket, "s1", key_id=weed.ACCESS_KEY, secret=weed.SECRET_KEY)],
            failing=[server.url(bucket, "s2", key_id=weed.ACCESS_KEY, secret=WRONG),
                     f"s3://me:{SECRET}@{bucket}/s3?endpoint={server.endpoint}",
                     server.url(bucket, "s4", key_id=weed.ACCESS_KEY, secret=OPTION_SECRET, part_size=1)],
            secrets=(weed.SECRET_KEY,),
        )  # fmt: skip
    finally:
        server.stop()


@contextlib.contextmanager
def _peer_store(tmp_path: Path) -> Iterator[Row]:
    pytest.importorskip("nixl_cu13", reason="NIXL is not installed (pip install nixl-cu13==1.5.1)")
    server = start_redis(tmp_path, "--requirepass", SECRET)
    try:
        port = server.port
        yield Row(
            # insecure=1: no cluster key here (the key's own scan is test_the_cluster_key_shows_nowhere's)
            working=[f"peer://default:{SECRET}@127.0.0.1:{port}/0?prefix=p1:&timeout=2&insecure=1"],
            expect=("ok", "ok", "missing", "missing", "missing"),
            failing=[f"peer://:{WRONG}@127.0.0.1:{port}/0?timeout=2&insecure=1",
                     f"peer://127.0.0.1:{port}/0?password={WRONG}&timeout=2&insecure=1",
                     f"peer://:{SECRET}@127.0.0.1:{port}/0?secret={OPTION_SECRET}"],
        )  # fmt: skip
    finally:
        server.stop()


#: scheme -> its row. A plugin that registers a scheme adds its row here.
STORES: dict[str, Callable[[Path], contextlib.AbstractContextManager[Row]] | None] = {
    "memory": _memory_store,
    "file": _file_store,
    "redis": _redis_store,
    "rediss": None,  # TLS Redis: a subclass of redis://'s backend with TLS options; covered by its row
    "mooncake": _mooncake_store,
    "s3": _s3_store,
    "peer": _peer_store,
}


def test_every_registered_scheme_has_a_row():
    registered = set(get_registry().storage_backends)
    missing = sorted(registered - set(STORES))
    assert not missing, (f"storage scheme(s) {missing} have no row in tests/test_storage_secrets.py STORES: add one "
                         "(a store with a planted secret), so their messages are scanned for credentials")  # fmt: skip
    backends = get_registry().storage_backends
    for alias in [s for s in STORES if STORES[s] is None and s in registered]:
        assert any(issubclass(backends[alias], backends[s]) for s in STORES if STORES[s] and s in backends), (
            f"{alias}:// has no row of its own and is no subclass of a scheme that has one"
        )


def _scan(texts: dict[str, str], extra: tuple[str, ...] = ()) -> None:
    leaks = [(where, secret) for where, text in texts.items() for secret in SECRETS + extra if secret in text]
    if leaks:
        where, secret = leaks[0]
        pytest.fail(f"a planted secret ({secret}) shows in {len(leaks)} place(s), first in {where}: "
                    f"{texts[where][:2000]}")  # fmt: skip


def _exception_texts(name: str, exc: BaseException) -> dict[str, str]:
    return {f"{name}: traceback": "".join(traceback.format_exception(exc)), f"{name}: repr": repr(exc)}


def _exercise(url: str, texts: dict[str, str], *, working: bool,
              expect: tuple[str, ...] = ("ok", "ok", "ok", "ok", "missing")) -> None:  # fmt: skip
    """Open ``url`` and use it as a server would; every text that comes out goes into ``texts``.

    A failing URL may fail when opened (a bad address) or at its first use (a wrong password: the
    client connects lazily); either way it must fail, and its errors are scanned.
    """
    shown = redact_url(url)
    host = make_pool(StorageCase("mha", "page_first", "plain", 4), pages=6)
    try:
        backend = make_storage(url, host, model_id="secrets-test")
    except Exception as exc:  # noqa: BLE001 - every failure is scanned; a working URL must not fail
        texts.update(_exception_texts(f"make_storage({shown})", exc))
        assert not working, f"{shown} should open: {redact_text(str(exc), SECRETS)}"
        return
    failures = 0
    try:
        texts[f"repr({shown})"] = repr(backend) + repr(backend.url) + str(backend.url)
        keys = page_hashes(list(range(12)), 4)
        try:
            results = backend.write_pages(keys[:2], slots_of([0, 1], 4))
            results += backend.read_pages(keys, slots_of([3, 4, 5], 4))
            texts[f"page results ({shown})"] = repr(results) + str(backend.batch_exists(keys))
        except Exception as exc:  # noqa: BLE001 - scanned; a working URL must not fail
            texts.update(_exception_texts(f"pages of {shown}", exc))
            assert not working, f"{shown} failed: {redact_text(str(exc), SECRETS)}"
            failures += 1
        else:
            statuses = tuple(r.status.value for r in results)
            if working:
                assert statuses == expect, results
            failures += statuses != expect
        texts[f"stats ({shown})"] = json.dumps(backend.get_stats().as_dict(), default=str)
        if working:
            from hicache_core.storage.controller import StorageController

            toks = list(range(16))
            with StorageController(backend, prefetch_policy="wait_complete", batch_pages=2) as ctl:
                ctl.backup(toks, host.alloc(16)).result(30)
                texts[f"controller ({shown})"] = repr(ctl.prefetch(toks).result(30)) + json.dumps(
                    ctl.stats(), default=str
                )
    finally:
        backend.close()
    assert working or failures, f"{shown} opened and worked; it was meant to fail"


@pytest.mark.parametrize("scheme", sorted(s for s in STORES if STORES[s]))
def test_no_secret_shows_anywhere(scheme, tmp_path, capsys, caplog):
    if scheme not in get_registry().storage_backends:
        pytest.skip(f"no installed plugin registers {scheme}://")
    caplog.set_level(logging.DEBUG)
    texts: dict[str, str] = {}
    with STORES[scheme](tmp_path) as row:
        assert row.working and row.failing
        for url in row.working:
            _exercise(url, texts, working=True, expect=row.expect)
        for url in row.failing:
            _exercise(url, texts, working=False)
        for url in row.working + row.failing:
            for command in ("check", "stats"):
                code = cli.main(["storage", command, url])
                out = capsys.readouterr()
                texts[f"hicache storage {command} {redact_url(url)} (exit {code})"] = out.out + out.err
                assert (code == 0) == (url in row.working and command == "check") or (command == "stats"), (
                    f"hicache storage {command} {redact_url(url)} exited {code}: {redact_text(out.out + out.err)}"
                )
    texts["logs"] = caplog.text + "".join(str(r.exc_info) + repr(r.args) for r in caplog.records)
    texts["metrics"] = json.dumps(metrics.snapshot(), default=str)
    assert any("***" in t for t in texts.values())  # the secrets were there to hide, and hidden
    _scan(texts, row.secrets)


CLUSTER_KEY = "Pl4nted-cluster-key-from-env-0123456789"  # HICACHE_L3_KEY: the pages' MAC key
CLUSTER_KEY_FILE = "Pl4nted-cluster-key-in-a-file-9876543210"  # what HICACHE_L3_KEY_FILE's file holds


@pytest.mark.parametrize("source", ["env", "file"])
@pytest.mark.parametrize("scheme", ["file", "redis", "s3", "mooncake"])
def test_the_cluster_key_shows_nowhere(scheme, source, tmp_path, capsys, caplog, monkeypatch):
    """With the cluster's L3 key set (environment or file), every scheme's texts are scanned for it too."""
    if scheme not in get_registry().storage_backends:
        pytest.skip(f"no installed plugin registers {scheme}://")
    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv("HICACHE_L3_KEY", raising=False)
    monkeypatch.delenv("HICACHE_L3_KEY_FILE", raising=False)
    if source == "env":
        monkeypatch.setenv("HICACHE_L3_KEY", CLUSTER_KEY)
    else:
        path = tmp_path / "cluster.key"
        path.write_text(CLUSTER_KEY_FILE + "\n")
        path.chmod(0o600)
        monkeypatch.setenv("HICACHE_L3_KEY_FILE", str(path))
    texts: dict[str, str] = {}
    with STORES[scheme](tmp_path) as row:
        for url in row.working[:1]:
            _exercise(url, texts, working=True, expect=row.expect)
            code = cli.main(["storage", "check", url])
            out = capsys.readouterr()
            texts[f"hicache storage check {redact_url(url)} (exit {code})"] = out.out + out.err
            assert code == 0, out.out + out.err
        for url in row.failing[:2]:
            _exercise(url, texts, working=False)
    # a key too short, from either source: refused, without the key in the message
    short = "Pl4nted-short-key"
    pool = make_pool(StorageCase("mha", "page_first", "plain", 4), pages=2)  # with the working key: it reads it
    monkeypatch.setenv("HICACHE_L3_KEY", short)
    monkeypatch.delenv("HICACHE_L3_KEY_FILE", raising=False)
    with pytest.raises(ValueError) as raised:
        make_storage(f"file://{tmp_path / 'short'}", pool, model_id="m")
    texts.update(_exception_texts("short key", raised.value))
    texts["logs"] = caplog.text + "".join(str(r.exc_info) + repr(r.args) for r in caplog.records)
    texts["metrics"] = json.dumps(metrics.snapshot(), default=str)
    assert any("key id=" in t for t in texts.values())  # the stores were keyed
    _scan(texts, row.secrets + (CLUSTER_KEY, CLUSTER_KEY_FILE, short))


class _Leaky(StorageBackend):
    """A planted plugin that puts its whole URL (password included) into every message it makes."""

    scheme = "leaky"
    capabilities = Capabilities()
    options_help = {"password": "a secret option", "fail": "1: every primitive raises"}

    def __init__(self, url, **options):
        super().__init__(url, **options)
        if options.get("fail") == "init":
            raise ConnectionError(f"cannot log in to {url.raw} with {options}")
        self.objects: dict[str, bytes] = {}

    def _boom(self):
        if self.options.get("fail") == "1":
            raise StorageError(f"{self.url.raw}: refused (password={self.options.get('password')})")

    def exists_objects(self, keys):
        self._boom()
        return [k in self.objects for k in keys]

    def put_objects(self, keys, values):
        self._boom()
        return [OSError(f"write to {self.url.raw} failed") for _ in keys]

    def get_objects(self, keys):
        self._boom()
        return [RuntimeError(f"read from {self.url.raw} failed") for _ in keys]

    def ping(self):
        raise StorageError(f"ping {self.url.raw}: no")

    def backend_stats(self):
        raise RuntimeError(f"stats of {self.url.raw} unavailable, token={self.options.get('password')}")


def test_the_core_redacts_what_a_plugin_leaks(caplog):
    """The redaction is the core's: a plugin that writes its URL into every message still shows no secret."""
    from hicache_core.plugins.registry import Registry

    registry = Registry()
    registry.storage_backends["leaky"] = _Leaky
    url = f"leaky://me:{SECRET}@store:1/x?password={OPTION_SECRET}"
    texts: dict[str, str] = {}
    with pytest.raises(ConnectionError) as raised:
        make_storage(url + "&fail=init", registry=registry)
    texts.update(_exception_texts("init", raised.value))
    host = make_pool(StorageCase("mha", "page_first", "plain", 4), pages=6)
    store = make_storage(url, host, model_id="m", registry=registry)
    keys = page_hashes(list(range(8)), 4)
    results = store.write_pages(keys, slots_of([0, 1], 4)) + store.read_pages(keys, slots_of([2, 3], 4))
    texts["results"] = repr(results)
    assert "write to leaky://me:***@store:1/x?password=***" in texts["results"]
    texts["stats"] = json.dumps(store.get_stats().as_dict(), default=str)
    for method in (store.ping, lambda: store.batch_exists(keys)):
        store.backend.options["fail"] = "1"
        with pytest.raises(StorageError) as raised:
            method()
        texts.update(_exception_texts(f"{method}", raised.value))
    texts["repr"] = repr(store)
    _scan(texts)
    assert "leaky://me:***@store:1/x" in texts["results"] and "***" in texts["stats"]


def test_redact_text_forms():
    url = f"redis://alice:{SECRET}@127.0.0.1:6379/0?password={OPTION_SECRET}&prefix=a"
    assert redact_text(url) == "redis://alice:***@127.0.0.1:6379/0?password=***&prefix=a"
    assert redact_text(f"got {url!r} then") == "got 'redis://alice:***@127.0.0.1:6379/0?password=***&prefix=a' then"
    assert redact_text(str({"password": SECRET, "db": 0})) == "{'password': '***', 'db': 0}"
    assert redact_text(f"AUTH failed for {SECRET}", [SECRET]) == "AUTH failed for ***"
    assert redact_text(f"x://u:p@ss:{SECRET}@h/") == "x://u:***@h/"  # '@' inside a password
    assert redact_text("authentication failed; oauth=1") == "authentication failed; oauth=1"
    chained = ValueError(f"outer {SECRET}")
    try:
        try:
            raise KeyError(f"inner {url}")
        except KeyError as inner:
            raise chained from inner
    except ValueError:
        pass
    chained.add_note(f"note {SECRET}")
    text = "".join(traceback.format_exception(scrub_exception(chained, [SECRET])))
    assert SECRET not in text and OPTION_SECRET not in text and "outer ***" in text and "note ***" in text
