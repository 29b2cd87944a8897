"""Call numbers (hicache_core.pool.drops): unique, none lost, and each thread's own, with calls from many threads.

A host pool is called from the caller's thread and from the layer loader's at once; a kernel that
masks an index stores the number of *its* call. The switch interval is made tiny so that threads
interleave inside the numbering (a read-add-store on a plain attribute repeats or loses numbers there).
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from hicache_core import MHADevicePool, make_host_pool
from hicache_core.pool.drops import HISTORY, DropReport

THREADS, CALLS = 8, 3000


@pytest.fixture
def tiny_switch_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _hammer(threads: int, work) -> None:
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            start.wait()
            work(t)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors, errors[:3]


def test_begin_from_many_threads_gives_every_number_once_and_each_thread_reads_its_own(tiny_switch_interval):
    report = DropReport(pinned=False)
    seen: list[list[int]] = [[] for _ in range(THREADS)]
    mismatched: list[tuple[int, int]] = []

    def implementation(expected: int) -> None:  # reads the number during its call, as a kernel launch does
        if report.seq != expected:
            mismatched.append((expected, report.seq))

    def work(t: int) -> None:
        for i in range(CALLS):
            seq = report.begin("load", t, i)
            implementation(seq)
            seen[t].append(seq)

    _hammer(THREADS, work)
    numbers = sorted(n for per_thread in seen for n in per_thread)
    assert numbers == list(range(1, THREADS * CALLS + 1)), "a call number was repeated or lost"
    assert not mismatched, mismatched[:5]
    last = numbers[-1]
    operation, layer_id, items = report._call(last)
    assert operation == "load" and items == CALLS - 1  # the latest call of some thread, remembered
    assert report._call(last - HISTORY) == (None, None, 0)  # its slot was taken by a later call: not named wrongly


def test_a_host_pools_calls_from_two_threads_each_see_their_own_number(tiny_switch_interval):
    """Loads on one thread and backups on another, through the pool's inline numbering: the number an
    implementation reads during its call is that call's, and every number from 1 to the count is used once."""
    dev = MHADevicePool(size=64, page_size=1, layer_num=2, head_num=1, head_dim=4, dtype=torch.float32, device="cpu")
    host = make_host_pool(dev, layout="layer_first", io_backend="direct")
    report = host.plan.drop_report
    impl = host.implementation_for("load_to_device_per_layer")
    assert impl is host.implementation_for("backup_from_device_per_layer")
    seen: dict[str, list[int]] = {"load": [], "backup": []}
    real_load, real_backup = impl.load_to_device_per_layer, impl.backup_from_device_per_layer

    def load(h, d, layer):
        seen["load"].append(report.seq)
        real_load(h, d, layer)

    def backup(h, d, layer):
        seen["backup"].append(report.seq)
        real_backup(h, d, layer)

    impl.load_to_device_per_layer, impl.backup_from_device_per_layer = load, backup
    h, d = host.alloc(8), torch.arange(8)
    calls = 1500

    def work(t: int) -> None:
        for i in range(calls):
            if t == 0:
                host.load_to_device_per_layer(dev, h, d, i % 2, "direct")
            else:
                host.backup_from_device_per_layer(dev, h, d, i % 2, "direct")

    _hammer(2, work)
    loads, backups = seen["load"], seen["backup"]
    assert len(loads) == len(backups) == calls
    assert sorted(loads + backups) == list(range(1, 2 * calls + 1)), "a call number was repeated or lost"
    assert loads == sorted(loads) and backups == sorted(backups)  # each thread's numbers grow
    last = 2 * calls  # the pool remembers the latest call under its own number
    expected = "load_to_device_per_layer" if loads[-1] == last else "backup_from_device_per_layer"
    assert report._call(last)[0] == expected
