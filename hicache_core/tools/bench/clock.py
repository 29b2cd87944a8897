"""The two clocks of ``hicache bench``: one call on an idle stream, and calls queued back to back.

``Timer`` times one call between two CUDA events on an idle stream, so the host's submission
of the launch shows in it. ``queued_seconds`` queues a batch of calls behind a short GPU sleep
and divides: the GPU time per call, what a server's layer-by-layer load pays once its host has
queued the loads ahead of the GPU (host time is measured on its own, per call).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class Timer:
    """Median wall time of a CUDA callable between events, repeated within a time box."""

    warmup: int = 2
    min_reps: int = 3
    max_reps: int = 20
    budget_s: float = 0.25

    def __call__(self, fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        slow = (time.perf_counter() - t0) / max(self.warmup, 1) > self.budget_s
        times: list[float] = []
        start_wall = time.perf_counter()
        while len(times) < self.max_reps:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
            if (slow or len(times) >= self.min_reps) and time.perf_counter() - start_wall > self.budget_s:
                break
        return statistics.median(times)


def queued_seconds(calls: Sequence[Callable[[], None]], trials: int = 5) -> float:
    """Median GPU seconds per call, with ``calls`` queued back to back behind a GPU sleep."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        # About a millisecond of GPU spin: the host has queued the whole batch before the first event.
        torch.cuda._sleep(2_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for call in calls:
            call()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3 / len(calls))
    return statistics.median(samples)


def batch_for(single_s: float, target_s: float = 2e-3) -> int:
    """How many calls to queue so that a batch lasts about ``target_s`` (4 to 32)."""
    return max(4, min(32, int(target_s / max(single_s, 1e-6))))


def host_us(fn: Callable[[], None], calls: int = 1000, batches: int = 5) -> float:
    """Host microseconds per call of ``fn``: the median over ``batches`` of ``calls`` calls each.

    The median of several batches, because a virtual machine's host is shared: one preemption
    inside a single batch of a few milliseconds would double its figure.
    """
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_batch = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        per_batch.append((time.perf_counter() - t) / calls)
        torch.cuda.synchronize()
    return statistics.median(per_batch) * 1e6
