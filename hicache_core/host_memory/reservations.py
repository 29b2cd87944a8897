"""Host memory that processes on this machine are about to take: reserved from their check until their pages exist.

Co-located ranks of one server build their host pools at about the same time. Each checks its pool against
what the kernel says is free (:func:`~.budget.check_fits`), and each sees the memory the others are about
to take as free: together they pass a check that none of them would pass after the others, and the machine
runs out of memory (the OOM killer, or a pinned pool that cannot be had).

The kernel counts a pool's memory (``MemAvailable``, the cgroup's usage) once its pages are touched, so only
the time from a pool's check until its pages are touched needs covering, and :func:`reserve` covers it:

* A host-wide ledger, one file (``/dev/shm``, else the temporary folder; one per user), holds one line per
  reservation: process id, the process's start time, a token, bytes, label. It is read and rewritten under
  an exclusive ``flock``. Every read drops the lines of processes that are gone (no such process, a zombie,
  or another process under a reused id: its start time differs), so a killed rank's reservation ends with it.
* :func:`reserve` checks the plan under that lock. A plan that does not fit what the kernel says is free is
  refused at once: others' reservations can only make it worse. A plan that fits that, but not once the
  other live reservations are taken off too, waits for them (polling) and checks again: each ends once its
  pages are touched, or its process ends. Waiting, not refusing, because a rank halfway through touching
  shows in both its reservation and ``MemAvailable``: a refusal then could refuse ranks that fit together.
  After ``wait_s`` it is refused all the same, naming the processes it waited for.
* A plan that fits is written to the ledger; its bytes are taken off as each buffer's pages are touched
  (:meth:`Reservation.touched`, before pinning, which takes no more memory), and the rest when the
  reservation is left, allocation failed or not.

``HICACHE_HOST_MEMORY_CHECK=0`` reserves without checking or waiting, so others still see the memory taken.
Where no ledger can be opened, a warning says so once and pools are built without reservations.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .budget import MEMORY_CHECK, HostMemoryPlan, fit_refusal

#: Seconds a plan waits for others' reservations before it is refused.
WAIT_S = 300.0
_POLL_S = 0.1
#: The ledger's file; ``None``: ``/dev/shm`` (else the temporary folder), one file per user.
LEDGER: Path | None = None
_log = logging.getLogger("hicache")
_WARNED: set[str] = set()
_THREAD_LOCK = threading.Lock()  # flock is per open file: threads of one process take turns before it
_OPEN_FD: int | None = None


@dataclass(frozen=True)
class Entry:
    """One reservation in the ledger."""

    pid: int
    started: str
    token: str
    nbytes: int
    label: str

    def line(self) -> str:
        return f"{self.pid} {self.started} {self.token} {self.nbytes} {self.label}\n"

    @classmethod
    def parse(cls, line: str) -> Entry | None:
        fields = line.rstrip("\n").split(" ", 4)
        if len(fields) < 4 or not fields[0].isdigit() or not fields[3].isdigit():
            return None
        return cls(int(fields[0]), fields[1], fields[2], int(fields[3]), fields[4] if len(fields) > 4 else "")


def ledger_path() -> Path:
    """Where the ledger is (``LEDGER``, else ``/dev/shm/hicache-host-memory-<uid>``, else the temporary folder)."""
    if LEDGER is not None:
        return Path(LEDGER)
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return folder / f"hicache-host-memory-{os.getuid()}"


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks after boot), or ``None`` where it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if not Path("/proc/self/stat").exists():  # no procfs: whether the id is taken is all there is
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                pass
            return "-"
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return None if fields[0] in ("Z", "X") else fields[19]


class _Ledger:
    """The ledger, opened and locked: its live entries; written back when leaving the ``with``, if changed.

    :raises OSError: the ledger cannot be opened.
    """

    def __init__(self) -> None:
        global _OPEN_FD
        _THREAD_LOCK.acquire()
        try:
            self.fd = _OPEN_FD = os.open(ledger_path(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except BaseException:
            _THREAD_LOCK.release()
            raise
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            raw = b""
            while chunk := os.pread(self.fd, 1 << 16, len(raw)):
                raw += chunk
        except BaseException:
            self._close()
            raise
        entries = [e for e in map(Entry.parse, raw.decode(errors="replace").splitlines()) if e is not None]
        starts: dict[int, str | None] = {}
        self.entries = [e for e in entries if starts.setdefault(e.pid, _started(e.pid)) == e.started]
        self.changed = len(self.entries) != len(entries)

    def __enter__(self) -> _Ledger:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.changed:
                data = "".join(e.line() for e in self.entries).encode()
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, data, 0)
        finally:
            self._close()

    def _close(self) -> None:
        global _OPEN_FD
        _OPEN_FD = None
        os.close(self.fd)  # releases the flock
        _THREAD_LOCK.release()


def _after_fork_in_child() -> None:
    """A fork in the middle of another thread's ledger update: the child neither waits for that thread nor keeps
    the ledger locked (the lock is the open file's, which the child shares until it closes its copy)."""
    global _THREAD_LOCK, _OPEN_FD
    _THREAD_LOCK = threading.Lock()
    if _OPEN_FD is not None:
        os.close(_OPEN_FD)
        _OPEN_FD = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Reservation:
    """Bytes of one plan reserved in the ledger until its pages are touched (see the module docstring)."""

    def __init__(self, token: str | None, nbytes: int) -> None:
        self.token, self.left = token, nbytes

    def touched(self, nbytes: int) -> None:
        """``nbytes`` of the plan now exist as pages: the kernel counts them, the reservation no longer does."""
        self._set(max(0, self.left - nbytes))

    def release(self) -> None:
        """End the reservation (idempotent)."""
        self._set(0)

    def _set(self, left: int) -> None:
        if self.token is None or left == self.left:
            return
        self.left = left
        try:
            with _Ledger() as ledger:
                ledger.entries = [e if e.token != self.token else Entry(e.pid, e.started, e.token, left, e.label)
                                  for e in ledger.entries if e.token != self.token or left > 0]  # fmt: skip
                ledger.changed = True
        except OSError as exc:  # the entry stays until this process ends; the pool itself is fine
            _warn_once(f"a host memory reservation could not be updated in {ledger_path()} ({exc})")
        if left == 0:
            self.token = None

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def reserve(plan: HostMemoryPlan, *, wait_s: float | None = None) -> Reservation:
    """Reserve ``plan``'s bytes on this host once they fit beside every other live reservation.

    :param wait_s: how long to wait for others' reservations to end (default :data:`WAIT_S`).
    :raises HostMemoryError: the plan does not fit what the kernel says is free, or not beside the others'
        reservations after ``wait_s`` (the message names their processes).
    """
    checking = MEMORY_CHECK.read()
    deadline = time.monotonic() + (WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            ledger = _Ledger()
        except OSError as exc:
            _warn_once(f"host memory reservations are off: the ledger {ledger_path()} cannot be opened ({exc}); "
                       "ranks that build host pools at once on this host can overcommit its memory")  # fmt: skip
            refused = fit_refusal(plan) if checking else None
            if refused is not None:
                raise refused from None
            return Reservation(None, 0)
        with ledger:
            reservation = _attempt(ledger, plan, checking, deadline)
        if reservation is not None:
            return reservation
        time.sleep(_POLL_S)


def _attempt(ledger: _Ledger, plan: HostMemoryPlan, checking: bool, deadline: float) -> Reservation | None:
    """``plan`` reserved in the locked ``ledger``, or ``None``: wait for others' reservations, then try again."""
    if checking:
        refused = fit_refusal(plan)  # what the kernel says is free: others' reservations only take from it
        if refused is None and ledger.entries:
            pending = sum(e.nbytes for e in ledger.entries)
            refused = fit_refusal(plan, pending=pending, pending_by=_who(ledger.entries))
            if refused is not None and time.monotonic() < deadline:
                return None
        if refused is not None:
            raise refused
    token = uuid.uuid4().hex
    ledger.entries.append(Entry(os.getpid(), _started(os.getpid()) or "-", token, plan.mapped,
                                plan.label.replace("\n", " ")))  # fmt: skip
    ledger.changed = True
    return Reservation(token, plan.mapped)


def _who(entries: list[Entry]) -> str:
    """The processes that hold ``entries``, for a refusal."""
    return ", ".join(f"pid {e.pid} ({e.label}: {e.nbytes} bytes)" for e in entries)


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        _log.warning("%s", message)
