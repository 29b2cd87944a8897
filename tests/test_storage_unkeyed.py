"""A store bound without the cluster key says so: one WARNING per process and URL, and in ``hicache storage check``."""

from __future__ import annotations

import json
import logging

import pytest
from test_settings_secrets import HICACHE, KEY, leaks, run_cli

from hicache_core.plugins.registry import Registry
from hicache_core.storage import StorageBackend, make_storage
from hicache_core.storage.backend import Capabilities
from hicache_core.storage.page_auth import ClusterKey
from hicache_core.testing.storage_kit import StorageCase, make_pool

PASSWORD = "Pl4nted-store-pw-4e1d"
UNKEYED = "is UNAUTHENTICATED (no cluster key"


class _Dict(StorageBackend):
    """A store behind a password, in a dict (its URL carries the password the warning must not show)."""

    scheme = "dictstore"
    capabilities = Capabilities(shared=True)
    options_help = {"password": "the store's password", "prefix": "a key prefix"}

    def __init__(self, url, **options):
        super().__init__(url, **options)
        self.objects: dict[str, bytes] = {}

    def exists_objects(self, keys):
        return [k in self.objects for k in keys]

    def put_objects(self, keys, values):
        for key, spans in zip(keys, values):
            self.objects[key] = b"".join(bytes(s.view) for s in spans)
        return [None] * len(keys)

    def get_objects(self, keys):
        return [self.objects.get(k, KeyError(k)) for k in keys]


@pytest.fixture
def no_key(monkeypatch):
    for var in ("HICACHE_L3_KEY", "HICACHE_L3_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)


def _unkeyed_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "hicache_core.storage" and UNKEYED in r.getMessage()]


def _host():
    return make_pool(StorageCase("mha", "page_first", "plain", 4), pages=4)


def test_two_stores_on_one_url_warn_once(tmp_path, caplog, no_key):
    caplog.set_level(logging.WARNING, logger="hicache_core.storage")
    url = f"file://{tmp_path / 'l3'}"
    stores = [make_storage(url, _host(), model_id="m"), make_storage(url, _host(), model_id="m")]
    try:
        (record,) = _unkeyed_records(caplog)
        assert record.levelno == logging.WARNING
        assert record.getMessage() == (
            f"L3 store {url} is UNAUTHENTICATED (no cluster key: HICACHE_L3_KEY_FILE and HICACHE_L3_KEY are unset, "
            "or cluster_key=None): its pages are written and read without a MAC, so anyone who can write the store "
            "can plant pages that this instance loads. Set HICACHE_L3_KEY_FILE to a file holding the cluster's key "
            "(openssl rand -hex 32 > FILE && chmod 600 FILE) on every instance; docs/security.md says what it "
            "protects."
        )
        other = make_storage(f"file://{tmp_path / 'other'}", _host(), model_id="m", cluster_key=None)
        stores.append(other)
        assert [f"file://{tmp_path / 'other'}" in r.getMessage() for r in _unkeyed_records(caplog)] == [False, True]
    finally:
        for store in stores:
            store.close()


def test_the_warning_hides_the_urls_password(caplog, no_key):
    caplog.set_level(logging.WARNING, logger="hicache_core.storage")
    registry = Registry()
    registry.storage_backends["dictstore"] = _Dict
    url = f"dictstore://me:{PASSWORD}@store:1/x?password={PASSWORD}&prefix=a"
    for _ in range(2):
        make_storage(url, _host(), model_id="m", registry=registry).close()
    assert caplog.text.count(PASSWORD) == 0  # counted, not quoted: a failure must not print it either
    (record,) = _unkeyed_records(caplog)
    assert "L3 store dictstore://me:***@store:1/x?password=***&prefix=a is UNAUTHENTICATED" in record.getMessage()


def test_only_a_bound_store_without_a_key_warns(tmp_path, caplog, monkeypatch, no_key):
    """Not with a key (given or from the environment), not unbound (no page moves), not ``memory://`` (this
    process's own memory: nothing outside it writes there)."""
    caplog.set_level(logging.DEBUG, logger="hicache_core.storage")
    make_storage(f"file://{tmp_path / 'keyed'}", _host(), model_id="m", cluster_key=ClusterKey(KEY.encode())).close()
    make_storage(f"file://{tmp_path / 'unbound'}").close()
    make_storage(f"memory://unkeyed-{tmp_path.name}", _host(), model_id="m").close()
    monkeypatch.setenv("HICACHE_L3_KEY", KEY)
    make_storage(f"file://{tmp_path / 'from-env'}", _host(), model_id="m").close()
    monkeypatch.delenv("HICACHE_L3_KEY")
    make_storage(f"file://{tmp_path / 'unkeyed'}", _host(), model_id="m").close()
    assert [r.getMessage().split(" is ")[0] for r in _unkeyed_records(caplog)] == [
        f"L3 store file://{tmp_path / 'unkeyed'}"
    ]
    assert leaks(caplog.text) == 0


def test_storage_check_says_loudly_that_pages_are_unauthenticated(tmp_path):
    (tmp_path / "l3").mkdir()  # the check inspects a store; it creates none
    url = f"file://{tmp_path / 'l3'}"
    code, out, err, _ = run_cli(HICACHE, "storage", "check", url)
    assert code == 0, out + err  # the store works; a missing key is the operator's choice, not a failed check
    lines = out.splitlines()
    assert lines[-2:] == [
        "  WARN pages UNAUTHENTICATED (no HICACHE_L3_KEY_FILE): whoever can write the store decides what loads; "
        "set HICACHE_L3_KEY_FILE to the cluster's key file on every instance",
        "all checks passed",
    ], out
    assert err.count(UNKEYED) == 1 and f"L3 store {url} {UNKEYED}" in err, err

    code, out, err, _ = run_cli(HICACHE, "storage", "check", url, "--json")
    report = json.loads(out)
    assert (code, report["ok"], report["authenticated"], report["key_id"]) == (0, True, False, None)
    assert report["warnings"] == [lines[-2].removeprefix("  WARN ")]

    # With the key (its text form: tests/test_settings_secrets.py): no warning, the key's id.
    code, out, err, leaked = run_cli(HICACHE, "storage", "check", url, "--json", HICACHE_L3_KEY=KEY)
    report = json.loads(out)
    assert (code, leaked, report["warnings"], report["authenticated"]) == (0, 0, [], True), out + err
    assert report["key_id"] == ClusterKey(KEY.encode()).key_id.hex() and UNKEYED not in err
