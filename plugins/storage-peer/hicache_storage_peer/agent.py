"""One NIXL agent per peer backend: registered host memory, remote agents, and reads with a deadline."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from hicache_core.storage.backend import StorageError

#: Seconds between polls of an in-flight transfer (the progress thread moves the bytes meanwhile).
_POLL_S = 20e-6
#: The UCX progress thread's poll() timeout (microseconds; NIXL rounds it up to whole milliseconds). It
#: wakes on its workers' events at once; the timeout only bounds a wake-up UCX fails to signal.
_PROGRESS_POLL_US = 1000


def _ucx_defaults() -> None:
    """UCX settings a CPU machine needs, set only where the user set nothing.

    Without InfiniBand or RoCE devices UCX's ``ib`` modules are useless, and when torch is loaded
    their libnl dependency crashes the process at exit (SIGSEGV in ``rtnl_tc_unregister`` during
    ``_dl_fini``, nixl-cu13 1.5.1): they are not loaded there.
    """
    ib = "/sys/class/infiniband"
    if not (os.path.isdir(ib) and os.listdir(ib)):
        os.environ.setdefault("UCX_MODULES", "^ib")


def load_nixl() -> Any:
    """NIXL's Python API module (``nixl_cu13`` or ``nixl_cu12``, whichever is installed)."""
    _ucx_defaults()
    for name in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise StorageError("peer:// needs NIXL's Python package: pip install nixl-cu13==1.5.1 (or nixl-cu12)")


def _nixl_agent(nixl: Any, name: str) -> Any:
    """NIXL's Python agent with the UCX backend, its progress thread sleeping in poll() between events.

    ``nixl_agent()`` (nixl-cu13 1.5.1) makes its core agent with ``pthrDelay = 0``: the UCX backend's
    progress thread then calls poll() with a zero timeout, a busy loop that holds a whole core per
    agent, idle or not (measured here: 0.99 of a core; with a 1 ms timeout, 0.03). The agent is made
    without backends, its core agent replaced by one of the same name with :data:`_PROGRESS_POLL_US`,
    and the UCX backend created on that one (the progress thread starts with the backend).
    """
    agent = nixl.nixl_agent(name, nixl.nixl_agent_config(backends=[]))
    config = nixl.nixlBind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.pthrDelay = _PROGRESS_POLL_US
    config.syncMode = nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value
    config.captureTelemetry = False
    agent.agent = nixl.nixlBind.nixlAgent(name, config)
    agent.create_backend("UCX", {})
    return agent


class TransferFailed(RuntimeError):
    """A NIXL transfer ended in an error (the remote agent went away, its memory was deregistered, ...)."""


class PeerAgent:
    """A NIXL agent with the UCX backend: registers local memory, reads remote memory, never waits unbounded.

    Every call holds one lock: NIXL's default thread mode for agents without a listener thread is
    unsynchronised, and the storage controller calls the backend from several threads.
    """

    def __init__(self, name: str) -> None:
        nixl = load_nixl()
        self.name = name
        try:
            self._agent = _nixl_agent(nixl, name)
        except Exception as exc:  # noqa: BLE001 - NIXL raises bare RuntimeErrors/nixlBind errors
            raise StorageError(f"peer://: NIXL agent {name!r} did not start ({exc})") from None
        if "UCX" not in self._agent.backends:
            raise StorageError(f"peer://: NIXL's UCX backend did not start (plugins found: {self._agent.plugin_list})")
        self._lock = threading.Lock()
        self._registered: list[Any] = []
        self._remote: dict[str, str] = {}  # owner id -> NIXL's name of the loaded remote agent
        self.transfers = 0
        self.transfer_timeouts = 0
        self.transfer_errors = 0
        self.release_failures = 0

    # ---- local memory ----------------------------------------------------------------------------

    def register(self, regions: Sequence[tuple[int, int]]) -> Any:
        """Register ``(address, nbytes)`` regions of DRAM for transfers (both as source and as target)."""
        with self._lock:
            descs = self._agent.get_reg_descs([(p, n, 0, "") for p, n in regions], "DRAM")
            self._agent.register_memory(descs)
            self._registered.append(descs)
            return descs

    @property
    def registrations(self) -> int:
        return len(self._registered)

    def metadata(self) -> bytes:
        """What another agent loads to read this one's registered memory."""
        with self._lock:
            return self._agent.get_agent_metadata()

    # ---- remote agents ---------------------------------------------------------------------------

    def connect(self, owner: str, metadata: bytes) -> None:
        """Load a remote agent's metadata once (until :meth:`forget` drops it).

        :raises TransferFailed: NIXL rejected the metadata (stale, malformed, or of an agent already loaded).
        """
        with self._lock:
            if owner not in self._remote:
                try:
                    self._remote[owner] = self._agent.add_remote_agent(metadata).decode()
                except Exception as exc:  # noqa: BLE001 - NIXL rejects bad or stale metadata with bare errors
                    raise TransferFailed(f"cannot load owner {owner}'s NIXL metadata ({exc})") from None

    def connected(self, owner: str) -> bool:
        return owner in self._remote

    @property
    def remotes(self) -> int:
        return len(self._remote)

    def forget(self, owner: str) -> None:
        """Drop a remote agent (its endpoints close); the next read from it loads its metadata again."""
        with self._lock:
            name = self._remote.pop(owner, None)
            if name is not None:
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001 - the agent may be half gone already; nothing else to release
                    pass

    # ---- reads -------------------------------------------------------------------------------------

    def post(self, owner: str, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]],
             op: str = "READ") -> Any:  # fmt: skip
        """Start reading remote ``(address, nbytes)`` runs of ``owner`` into local runs of the same sizes.

        ``op="WRITE"`` writes the local runs there instead (the tier never does; its tests play an outsider).
        """
        with self._lock:
            name = self._remote.get(owner)
            if name is None:
                raise TransferFailed(f"owner {owner} is not connected")
            a = self._agent
            try:
                handle = a.initialize_xfer(op, a.get_xfer_descs([(p, n, 0) for p, n in local], "DRAM"),
                                           a.get_xfer_descs([(p, n, 0) for p, n in remote], "DRAM"), name)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - NIXL's own errors (nixlNotFoundError, ...): this read only
                self.transfer_errors += 1
                raise TransferFailed(f"NIXL refused a {op} from {owner} ({type(exc).__name__}: {exc})") from None
            self.transfers += 1
            try:
                state = a.transfer(handle)
            except Exception as exc:  # noqa: BLE001
                state = f"ERR ({exc})"
        return [handle, state]

    def wait(self, owner: str, posted: Any, deadline: float) -> None:
        """Wait for a posted read until ``deadline``.

        :raises TimeoutError: not done by the deadline: the transfer is cancelled and the remote agent
            dropped. Bytes may still land in its local runs afterwards (observed over UCX/TCP after a
            paused owner resumed): the caller must never hand those runs out again.
        :raises TransferFailed: NIXL reported an error.
        """
        handle, state = posted
        a = self._agent
        while state == "PROC":
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
            with self._lock:
                try:
                    state = a.check_xfer_state(handle)
                except Exception as exc:  # noqa: BLE001
                    state = f"ERR ({exc})"
        if state == "DONE":
            with self._lock:
                a.release_xfer_handle(handle)
            posted[1] = "released"
            return
        self.abandon(owner, [posted])
        if state == "PROC":
            self.transfer_timeouts += 1
            raise TimeoutError(f"NIXL read from {owner} not done within the deadline")
        self.transfer_errors += 1
        raise TransferFailed(f"NIXL read from {owner} failed: {state}")

    def abandon(self, owner: str, posted: Sequence[Any]) -> None:
        """Cancel posted reads that will not be waited for, and drop their remote agent."""
        with self._lock:
            for p in posted:
                if p[1] == "released":
                    continue
                try:
                    self._agent.release_xfer_handle(p[0])  # NIXL cancels an active request here
                except Exception:  # noqa: BLE001 - one it cannot cancel ends when the remote agent is dropped
                    self.release_failures += 1
                p[1] = "released"
        self.forget(owner)

    def read(self, owner: str, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]],
             deadline: float) -> None:  # fmt: skip
        """:meth:`post` then :meth:`wait`."""
        if local:
            self.wait(owner, self.post(owner, local, remote), deadline)

    def close(self) -> None:
        """Drop every remote agent, deregister all memory, and let the agent go (its progress thread stops)."""
        if self._agent is None:
            return
        for owner in list(self._remote):
            self.forget(owner)
        with self._lock:
            while self._registered:
                self._agent.deregister_memory(self._registered.pop())
            self._agent = None
