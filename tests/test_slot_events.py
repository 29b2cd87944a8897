"""Free listeners: a tier serving a pool's pages hears of freed slots before they can be handed out again."""

from __future__ import annotations

from hicache_core import slot_events
from hicache_core.testing.storage_kit import StorageCase, make_pool


def test_free_and_clear_tell_listeners_before_the_slots_are_free_again():
    host = make_pool(StorageCase("mha", "page_first", "plain", 4), pages=4)
    heard = []

    def listener(pool, slots):
        # Still allocated while the listener runs: nobody can have been handed these slots yet.
        heard.append((pool is host, None if slots is None else slots.tolist(), host.available_size()))

    slots = host.alloc(8)
    slot_events.add_free_listener(listener)
    try:
        host.free(slots[:4])
        host.clear()
    finally:
        slot_events.remove_free_listener(listener)
    host.free(host.alloc(4))  # not heard any more
    assert heard == [(True, slots[:4].tolist(), 8), (True, None, 12)]
