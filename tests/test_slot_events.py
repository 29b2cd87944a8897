"""Free listeners: a tier serving a pool's pages hears of freed slots before they can be handed out again."""

from __future__ import annotations

import pytest

from hicache_core.pool import slot_events
from hicache_core.testing.storage_kit import StorageCase, make_pool


def _listener(host, heard):
    def listener(pool, slots):
        # Still allocated while the listener runs: nobody can have been handed these slots yet.
        heard.append((pool is host, None if slots is None else slots.tolist(), host.available_size()))

    return listener


def test_free_and_clear_tell_an_observer_of_the_pool_before_the_slots_are_free_again():
    host = make_pool(StorageCase("mha", "page_first", "plain", 4), pages=4)
    other = make_pool(StorageCase("mha", "page_first", "plain", 4), pages=4)
    heard = []
    observer = slot_events.FreeListener(_listener(host, heard), host)
    slots = host.alloc(8)
    host.observe(observer)
    try:
        other.free(other.alloc(4))  # another pool's slots: not heard
        host.free(slots[:4])
        host.clear()
    finally:
        host.unobserve(observer)
    host.free(host.alloc(4))  # not heard any more
    assert heard == [(True, slots[:4].tolist(), 8), (True, None, 12)]
    with pytest.raises(ValueError, match="does not observe this pool"):
        host.unobserve(observer)


def test_the_deprecated_process_wide_listener_still_hears_every_pool():
    host = make_pool(StorageCase("mha", "page_first", "plain", 4), pages=4)
    heard = []
    listener = _listener(host, heard)
    slots = host.alloc(8)
    with pytest.warns(DeprecationWarning, match="observe the pool"):
        slot_events.add_free_listener(listener)
    try:
        host.free(slots[:4])
        host.clear()
    finally:
        slot_events.remove_free_listener(listener)
    host.free(host.alloc(4))  # not heard any more
    assert heard == [(True, slots[:4].tolist(), 8), (True, None, 12)]


def test_a_pool_with_no_observer_but_metrics_checks_nothing_more_on_free():
    host = make_pool(StorageCase("mha", "page_first", "plain", 4), pages=4)
    assert [type(o).__name__ for o in host.observers] == ["TransferMetrics"]  # CPU pools do not verify by default
    with pytest.raises(TypeError, match="subclasses hicache_core.PoolObserver"):
        host.observe(print)
