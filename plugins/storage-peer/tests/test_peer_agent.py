"""The NIXL agent of the peer tier between transfers: its threads wait for events instead of spinning."""

from __future__ import annotations

import os
import time

from hicache_storage_peer.agent import PeerAgent


def _thread(tid: str) -> tuple[int, int]:
    """A thread's voluntary context switches (it blocked) and its CPU time in clock ticks."""
    with open(f"/proc/self/task/{tid}/status") as f:
        voluntary = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return voluntary, int(fields[11]) + int(fields[12])


def test_an_idle_agent_leaves_the_cores_alone():
    """NIXL 1.5.1's Python agent polls UCX without a pause (a core per instance); the tier's agent sleeps in poll().

    A thread that polls without pausing uses CPU and never blocks (measured: 80-95 ticks of CPU in a
    second, no voluntary context switch); one that waits in poll() for an event or its 1 ms timeout
    blocks about a thousand times a second and uses a tick or two.
    """
    before = set(os.listdir("/proc/self/task"))
    agent = PeerAgent(f"idle-{os.getpid()}")
    try:
        threads = sorted(set(os.listdir("/proc/self/task")) - before)
        assert threads, "the NIXL agent started no thread (its UCX progress thread was expected)"
        start = {tid: _thread(tid) for tid in threads}
        time.sleep(1.0)
        seen = {tid: tuple(b - a for a, b in zip(start[tid], _thread(tid))) for tid in threads}
    finally:
        agent.close()
    spinning = {tid: s for tid, s in seen.items() if s[1] > s[0]}
    assert not spinning, f"threads of the idle agent used more CPU ticks than they blocked (blocked, ticks): {seen}"
