"""The conformance kit for L3 storage backends.

A storage plugin subclasses :class:`StorageConformanceTests` in a test module and
overrides two fixtures: ``storage_url`` (a URL of a live store, e.g. a temporary
directory or a server the fixture started) and, for the corruption test,
:meth:`StorageConformanceTests.corrupt_object`::

    class TestFile(StorageConformanceTests):
        @pytest.fixture
        def storage_url(self, tmp_path):
            return f"file://{tmp_path}"

        def corrupt_object(self, backend, key, offset):
            ...flip the byte at ``offset`` of the stored object ``key`` (``backend`` is the plugin's object)...

Round trips are generated from the registry: every pool kind any registered layout
stores, times every layout that stores it, so a new pool kind or layout is covered
without touching the kit. Each test uses its own model id, so tests never see each
other's pages in a shared store.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from ..plugins.registry import Registry, get_registry
from ..pool.host_pool import make_host_pool
from ..storage.backend import PageStatus, StorageBackend
from ..storage.keys import Namespace, page_hashes
from ..storage.make import make_storage
from ..storage.page_auth import ClusterKey
from ..storage.page_store import PageStore
from . import cases as C


@dataclass(frozen=True)
class StorageCase:
    """One generated round-trip case: a pool kind, a layout, a pool variant and a page size."""

    pool_kind: str
    layout: str
    variant: str
    page_size: int

    @property
    def id(self) -> str:
        return f"{self.pool_kind}-{self.layout}-{self.variant}-p{self.page_size}"


def storage_cases(registry: Registry, variants=("plain", "sharded", "draft"), page_sizes=(1, 4)) -> list[StorageCase]:
    """Every registered pool kind x every layout that may store it, times variants and page sizes.

    A layout that turns out not to fit a kind (structurally) is skipped with the pool's reason at run time.
    """
    kinds = getattr(registry, "pool_kinds", None) or {
        k: None for layout in registry.layouts.values() for k in (layout.pool_kinds or ())
    }

    def fits(kind: str, name: str, layout: Any) -> bool:
        allowed = getattr(kinds[kind], "layouts", None)  # a pool kind may name the only layouts it takes
        return layout.allows(kind) and (allowed is None or name in allowed)

    return [
        StorageCase(kind, name, variant, p)
        for kind in sorted(kinds)
        for name, layout in sorted(registry.layouts.items())
        if fits(kind, name, layout)
        for variant in variants
        for p in page_sizes
    ]


def _kit_verify() -> bool | None:
    """Verification of the kit's pools: as ``HICACHE_VERIFY`` says (CI runs the tiers with it on and a cluster
    key set, as a GPU server runs them), except where no key is set: a verifying pool without one writes
    device-checked pages, whose payload only a load to the device checks, and these pools are never loaded
    to a device, so the kit holds the backend to the host-checked format there (tests/test_verify.py covers
    device-checked pages)."""
    return None if ClusterKey.from_environment() is not None else False


def make_pool(case: StorageCase, *, pages: int = 10, seed: int = 0) -> Any:
    """A host pool of ``case`` holding ``pages`` pages of random bytes (only host memory is used)."""
    device_pool, drafts = C.build_device_pools(case.pool_kind, case.variant, case.page_size, "cpu")
    p = case.page_size
    device_tokens = int(getattr(device_pool, "size", 0) or 0)
    size = max(pages * p, -(-device_tokens // p) * p)  # a host pool is never smaller than its device pool
    verify = _kit_verify()  # a bad key is the caller's error, not a layout this kind cannot hold
    try:
        host = make_host_pool(device_pool, layout=case.layout, io_backend="reference", operations=[],
                              draft_pools=drafts, size=size, verify=verify)  # fmt: skip
    except ValueError as exc:  # the layout cannot hold this kind: nothing to store
        pytest.skip(f"{case.id}: no host pool: {str(exc).splitlines()[0]}")
    C.fill_random(list(host.plan.host_buffers.values()), torch.Generator().manual_seed(seed))
    return host


def page_bytes(host: Any, page: int) -> torch.Tensor:
    """The flat bytes of page ``page`` (a copy)."""
    return C.as_bytes(host.get_data_page(page * host.page_size, flat=True)).clone()


def pool_image(host: Any) -> dict[str, torch.Tensor]:
    return {name: C.as_bytes(t).clone() for name, t in host.plan.host_buffers.items()}


def flipped_payload(store: PageStore) -> tuple[PageStatus, str]:
    """What a read reports for a payload byte changed in the store, and the statistic that counts it.

    With a cluster key the page's MAC covers every byte and is checked first: ``auth_failed`` (a flip and a
    forgery look alike); without one the payload checksum fails: ``corrupt``. Either way the page is not loaded.
    """
    if store.authenticated:
        return PageStatus.AUTH_FAILED, "read_auth_failed"
    return PageStatus.CORRUPT, "read_corrupt"


def slots_of(pages: list[int], page_size: int) -> torch.Tensor:
    return C.pages_of(torch.tensor(pages, dtype=torch.int64), page_size)


def tokens(n_pages: int, page_size: int, salt: int) -> list[int]:
    return [(salt * 7919 + i) % 50000 for i in range(n_pages * page_size)]


class StorageConformanceTests:
    """Conformance tests for one storage backend; subclass it and override ``storage_url``.

    Class attributes narrow the generated round trips: :attr:`variants` (``plain``,
    ``sharded``, ``draft``) and :attr:`page_sizes`. :attr:`storage_options` are passed to
    :func:`make_storage`.
    """

    variants: ClassVar[tuple[str, ...]] = ("plain", "sharded", "draft")
    page_sizes: ClassVar[tuple[int, ...]] = (1, 4)
    storage_options: ClassVar[dict[str, Any]] = {}

    # ---- what a backend's test class provides ---------------------------------------------------

    @pytest.fixture
    def storage_url(self) -> str:
        pytest.fail("override the storage_url fixture: return the URL of a live store for this test", pytrace=False)

    def corrupt_object(self, backend: StorageBackend, key: str, offset: int) -> None:
        """Flip the byte at ``offset`` of the stored object ``key`` (a full key), through the store itself."""
        raise NotImplementedError("override corrupt_object to let the kit damage a stored value")

    # ---- helpers -------------------------------------------------------------------------------

    @classmethod
    def hicache_parametrize(cls, metafunc: pytest.Metafunc) -> None:
        """Parametrize ``storage_case`` with every pool kind x layout of the registry."""
        if "storage_case" not in metafunc.fixturenames:
            return
        found = storage_cases(get_registry(), cls.variants, cls.page_sizes)
        metafunc.parametrize("storage_case", found, ids=[c.id for c in found])

    @pytest.fixture
    def model_id(self) -> str:
        return f"kit-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def open_storage(self, storage_url, model_id):
        """``open_storage(host_pool, **kw)``: a bound page store of the URL under test, closed after the test."""
        made: list[PageStore] = []
        self._written: dict[int, list[str]] = {}  # full keys each store wrote, removed after the test

        def opener(host: Any, **kw: Any) -> PageStore:
            kw.setdefault("model_id", model_id)
            store = make_storage(storage_url, host, **{**self.storage_options, **kw})
            made.append(store)
            return store

        yield opener
        for store in made:
            try:
                store.backend.remove_objects(self._written.get(id(store), []))
            except Exception:  # noqa: BLE001 - best-effort cleanup of a shared store
                pass
            store.close()

    def _write(self, store: PageStore, keys: list[str], pages: list[int]) -> list:
        self._written.setdefault(id(store), []).extend(store.namespace.keys(keys))
        return store.write_pages(keys, slots_of(pages, store.host_pool.page_size))

    # ---- the tests -----------------------------------------------------------------------------

    def test_registered_with_capabilities(self, storage_url):
        """The URL's scheme is registered by an installed plugin and declares its capabilities."""
        from ..storage.backend import Capabilities
        from ..storage.url import StorageURL

        registry = get_registry()
        scheme = StorageURL.parse(storage_url).scheme
        assert scheme in registry.storage_backends, f"no backend registered for {scheme}://"
        cls = registry.storage_backends[scheme]
        assert isinstance(cls.capabilities, Capabilities)
        assert cls.description, "a storage backend describes itself in one line"

    def test_round_trip(self, storage_case, open_storage):
        """Pages written out of one host pool land byte-exact in another, and nothing else changes."""
        src = make_pool(storage_case, seed=1)
        dst = make_pool(storage_case, seed=2)
        writer, reader = open_storage(src), open_storage(dst)
        keys = page_hashes(tokens(4, storage_case.page_size, 1), storage_case.page_size)
        out_pages, in_pages = [7, 2, 5, 3], [1, 8, 4, 6]
        assert all(r.ok for r in self._write(writer, keys, out_pages))
        assert reader.batch_exists(keys) == 4
        before = pool_image(dst)
        results = reader.read_pages(keys, slots_of(in_pages, storage_case.page_size))
        assert [r.status for r in results] == [PageStatus.OK] * 4, results
        for o, i in zip(out_pages, in_pages):
            assert torch.equal(page_bytes(src, o), page_bytes(dst, i)), f"page {o} -> {i} differs"
        self._assert_untouched(dst, before, except_pages=in_pages)
        flat = reader.get(keys[1])  # the flat-page path gives the same bytes
        assert flat is not None and torch.equal(C.as_bytes(flat), page_bytes(src, 2))

    def test_flat_page_set_and_get(self, open_storage):
        """``set`` of a flat page and ``get`` of it round-trip, for backends and callers without zero-copy."""
        case = StorageCase("mha", "page_first", "plain", 4)
        host = make_pool(case, seed=3)
        store = open_storage(host)
        (key,) = page_hashes(tokens(1, 4, 3), 4)
        self._written[id(store)] = store.namespace.keys([key])
        assert store.set(key, host.get_data_page(2 * 4, flat=True))
        got = store.get(key)
        assert got is not None and torch.equal(C.as_bytes(got), page_bytes(host, 2))
        assert store.get("0" * 64) is None

    def test_prefix_exists_and_missing_keys(self, open_storage):
        """``batch_exists`` counts leading stored pages; missing pages read as ``missing`` and touch nothing."""
        case = StorageCase("mla", "page_first", "plain", 4)
        host = make_pool(case, seed=4)
        store = open_storage(host)
        keys = page_hashes(tokens(6, 4, 4), 4)
        assert all(r.ok for r in self._write(store, keys[:2] + keys[3:5], [1, 2, 3, 4]))
        assert store.batch_exists(keys) == 2
        assert store.batch_exists(keys[3:]) == 2
        assert store.batch_exists(keys[2:]) == 0
        assert store.batch_exists([]) == 0
        before = pool_image(host)
        results = store.read_pages([keys[2], keys[5]], slots_of([6, 7], 4))
        assert [r.status for r in results] == [PageStatus.MISSING] * 2
        self._assert_untouched(host, before, except_pages=[6, 7] if store.backend.capabilities.zero_copy else [])
        assert store.get_stats().read_missing == 2

    def test_concurrent_writers_of_one_key(self, open_storage):
        """Writers racing on one key leave one whole page, never a mixture."""
        case = StorageCase("mha", "page_first_direct", "plain", 4)
        pools = [make_pool(case, seed=10 + i) for i in range(4)]
        stores = [open_storage(p) for p in pools]
        (key,) = page_hashes(tokens(1, 4, 5), 4)
        errors: list[BaseException] = []
        start = threading.Barrier(len(stores))

        def write(store: PageStore) -> None:
            try:
                start.wait(10)
                for _ in range(5):
                    assert all(r.ok for r in self._write(store, [key], [1]))
            except BaseException as exc:  # noqa: BLE001 - collected, asserted below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(b,)) for b in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        dst = make_pool(case, seed=99)
        reader = open_storage(dst)
        (result,) = reader.read_pages([key], slots_of([2], 4))
        assert result.ok, result
        got = page_bytes(dst, 2)
        assert any(torch.equal(got, page_bytes(p, 1)) for p in pools), "the stored page is a mixture of writers"

    def test_corrupted_value_is_a_counted_miss(self, open_storage):
        """A byte flipped in the store makes the page ``corrupt``: counted, never reported loaded."""
        case = StorageCase("mha", "layer_first", "plain", 4)
        host = make_pool(case, seed=6)
        store = open_storage(host)
        keys = page_hashes(tokens(3, 4, 6), 4)
        assert all(r.ok for r in self._write(store, keys, [1, 2, 3]))
        self.corrupt_object(store.backend, store.namespace.key(keys[1]), 80 + 5)  # a payload byte
        self.corrupt_object(store.backend, store.namespace.key(keys[2]), 30)  # a header byte
        dst = make_pool(case, seed=7)
        before = pool_image(dst)
        reader = open_storage(dst)
        results = reader.read_pages(keys, slots_of([4, 5, 6], 4))
        flipped, counter = flipped_payload(reader)
        assert [r.status for r in results] == [PageStatus.OK, flipped, PageStatus.CORRUPT], results
        assert torch.equal(page_bytes(dst, 4), page_bytes(host, 1))
        touched = [4, 5, 6] if reader.backend.capabilities.zero_copy else [4]
        self._assert_untouched(dst, before, except_pages=touched)
        stats = reader.get_stats()
        assert stats.read_corrupt + stats.read_auth_failed == 2 and getattr(stats, counter) >= 1
        assert reader.batch_get_into(keys, slots_of([4, 5, 6], 4)) == [True, False, False]

    def test_other_geometry_is_never_loaded(self, open_storage, model_id):
        """Pages of another layout are not found; forced under the same keys they are a counted ``mismatch``."""
        writer_case = StorageCase("mha", "page_first", "plain", 4)
        reader_case = StorageCase("mha", "page_first_direct", "plain", 4)  # same page size in bytes
        src, dst = make_pool(writer_case, seed=8), make_pool(reader_case, seed=9)
        writer = open_storage(src)
        keys = page_hashes(tokens(2, 4, 8), 4)
        assert all(r.ok for r in self._write(writer, keys, [1, 2]))
        reader = open_storage(dst)
        assert reader.namespace != writer.namespace and reader.batch_exists(keys) == 0
        forced = open_storage(dst)
        forced.namespace = Namespace(writer.namespace.model_id, writer.namespace.fingerprint, writer.namespace.share)
        before = pool_image(dst)
        results = forced.read_pages(keys, slots_of([3, 4], 4))
        assert [r.status for r in results] == [PageStatus.MISMATCH] * 2, results
        if not forced.backend.capabilities.zero_copy:
            self._assert_untouched(dst, before, except_pages=[])
        assert forced.get_stats().read_mismatch == 2

    def test_per_page_failures_are_reported(self, open_storage):
        """A backend failing some pages of a batch: exactly those report failure; the rest are stored and loaded."""
        case = StorageCase("page_rows", "page_first", "plain", 4)
        host = make_pool(case, seed=11)
        store = open_storage(host)
        keys = page_hashes(tokens(4, 4, 11), 4)
        real_put = store.backend.put_objects
        bad = set(store.namespace.keys([keys[1], keys[3]]))

        def put_failing_some(full_keys, values):
            good = [(k, v) for k, v in zip(full_keys, values) if k not in bad]
            done = iter(real_put([k for k, _ in good], [v for _, v in good]))
            return [OSError(5, "injected failure") if k in bad else next(done) for k in full_keys]

        store.backend.put_objects = put_failing_some
        results = self._write(store, keys, [1, 2, 3, 4])
        assert [r.ok for r in results] == [True, False, True, False]
        assert "injected failure" in results[1].detail
        assert store.get_stats().write_failed == 2
        del store.backend.put_objects
        assert store.backend.exists_objects(store.namespace.keys(keys)) == [True, False, True, False]

    def test_backend_raising_mid_batch(self, open_storage):
        """A read that raises halfway fails its batch (reported per page); pages outside it are untouched."""
        case = StorageCase("mha", "page_first", "plain", 4)
        src = make_pool(case, seed=12)
        writer = open_storage(src)
        keys = page_hashes(tokens(4, 4, 12), 4)
        assert all(r.ok for r in self._write(writer, keys, [1, 2, 3, 4]))
        dst = make_pool(case, seed=13)
        reader = open_storage(dst)
        reader_name = "get_objects_into" if reader.backend.capabilities.zero_copy else "get_objects"
        real = getattr(reader.backend, reader_name)

        def raise_halfway(full_keys, *rest):
            half = len(full_keys) // 2
            real(full_keys[:half], *[r[:half] for r in rest])  # the first half really moves
            raise ConnectionError("store went away mid-batch")

        setattr(reader.backend, reader_name, raise_halfway)
        before = pool_image(dst)
        results = reader.read_pages(keys, slots_of([5, 6, 7, 8], 4))
        assert [r.status for r in results] == [PageStatus.ERROR] * 4
        assert all("store went away mid-batch" in r.detail for r in results)
        self._assert_untouched(dst, before, except_pages=[5, 6, 7, 8])
        assert reader.get_stats().read_failed == 4
        delattr(reader.backend, reader_name)
        assert reader.batch_get_into(keys, slots_of([5, 6, 7, 8], 4)) == [True] * 4

    def test_bad_input_is_refused_before_any_byte_moves(self, open_storage):
        """Wrong lengths, partial pages, out-of-range or repeated pages and bad keys raise; nothing is stored."""
        case = StorageCase("mha", "page_first", "plain", 4)
        host = make_pool(case, seed=14)
        store = open_storage(host)
        keys = page_hashes(tokens(2, 4, 14), 4)
        before = pool_image(host)
        bad_calls = [
            ((ValueError,), "host slots", lambda: store.batch_set_from(keys, slots_of([1], 4))),
            ((ValueError,), "whole pages", lambda: store.batch_set_from(keys, slots_of([1, 2], 4) + 1)),
            ((IndexError,), "outside", lambda: store.batch_get_into(keys, slots_of([1, 99], 4))),
            ((ValueError,), "same page", lambda: store.batch_get_into(keys, slots_of([3, 3], 4))),
            ((TypeError,), "1-D", lambda: store.batch_set_from(keys, slots_of([1, 2], 4).float())),
            ((TypeError,), "page hash", lambda: store.batch_set_from([keys[0], 7], slots_of([1, 2], 4))),
            ((TypeError,), "list of page hashes", lambda: store.batch_exists(keys[0])),
        ]
        for types, words, call in bad_calls:
            with pytest.raises(types) as info:
                call()
            assert words in str(info.value), f"{info.value!r} should say {words!r}"
        assert store.backend.exists_objects(store.namespace.keys(keys)) == [False, False]
        self._assert_untouched(host, before, except_pages=[])

    def test_stats_count_reads_and_writes(self, open_storage):
        """Written and read pages and bytes are counted; the store's own figures come along."""
        case = StorageCase("mla", "page_first_direct", "plain", 4)
        host = make_pool(case, seed=15)
        store = open_storage(host)
        keys = page_hashes(tokens(3, 4, 15), 4)
        self._write(store, keys, [1, 2, 3])
        store.read_pages(keys, slots_of([4, 5, 6], 4))
        stats = store.get_stats().as_dict()
        assert stats["pages_written"] == 3 and stats["pages_read"] == 3
        assert stats["bytes_written"] == stats["bytes_read"] == 3 * (store.page_bytes + 80)
        assert isinstance(stats["backend"], dict) and "error" not in stats["backend"], stats["backend"]

    # ---- assertions ----------------------------------------------------------------------------

    @staticmethod
    def _assert_untouched(host: Any, before: dict[str, torch.Tensor], except_pages: list[int]) -> None:
        """Every byte of ``host`` equals ``before``, except the pages listed."""
        after = pool_image(host)
        restore = {p: page_bytes(host, p) for p in except_pages}
        for p in except_pages:  # compare with those pages put back as they were
            host.set_from_flat_data_page(p * host.page_size, flat_from(before, host, p))
        try:
            for name, image in before.items():
                assert torch.equal(C.as_bytes(host.plan.host_buffers[name]), image), f"host {name} changed"
        finally:
            for p, data in restore.items():
                host.set_from_flat_data_page(p * host.page_size, data.view(host.dtype))
        del after


def flat_from(image: dict[str, torch.Tensor], host: Any, page: int) -> torch.Tensor:
    """Page ``page`` as it was in ``image`` (a pool image from :func:`pool_image`), flat, in the pool's dtype."""
    saved = {name: C.as_bytes(t).clone() for name, t in host.plan.host_buffers.items()}
    try:
        for name, data in image.items():
            C.as_bytes(host.plan.host_buffers[name]).copy_(data)
        return host.get_data_page(page * host.page_size, flat=True).clone()
    finally:
        for name, data in saved.items():
            C.as_bytes(host.plan.host_buffers[name]).copy_(data)
