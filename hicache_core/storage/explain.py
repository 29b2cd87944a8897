"""Why a prefix missed: each page's place (host tier, store) and the reason the rest are not there.

Two sources, put together per page:

* **the store, now**: is the page under this namespace's key, and does it read back sound
  (a verification read into a scratch page: the header and the checksum are checked as a
  prefetch would)? A page that is absent here but present under the same model and share
  with *another layout's* geometry fingerprint is a ``layout_mismatch``.
* **the controller's memory**: the last outcome of each key (bounded: :class:`Outcomes`
  keeps the most recent ``capacity`` keys), which alone can say ``timed_out``,
  ``ranks_disagreed``, ``host_pool_full`` and the like, since those leave no trace in the store.

Reason codes (:data:`REASONS`): ``in_host`` (the caller's host tier holds it), ``in_store`` (the
store holds it sound: the next prefetch would hit), ``loaded`` (the last prefetch brought it to
the host tier), ``not_in_store``, ``checksum_failed``, ``layout_mismatch``, ``auth_failed`` (the
cluster key does not authenticate the stored page: written without it or with another key, changed,
or copied under another key), ``timed_out``,
``ranks_disagreed``, ``host_pool_full``, ``queue_full``, ``cancelled``, ``store_unreachable``,
``earlier_page_missing`` / ``earlier_page_failed`` (a prefix is only usable up to its first
missing page), ``old_weight_version`` (not under this weight version's key, but stored under the
key of weights the server replaced: a page of the old weights is never loaded), ``dropped_under_lease``
(the store evicted it lately although a lease covered it, and the detail says why: superseded, over the
retention cap, or the lightest lease when nothing else was left), ``error``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .backend import PageStatus
from .keys import Namespace, fingerprint, geometry_description, page_hashes
from .page_store import PageStore, check_keys
from .weights import OLD_WEIGHT_VERSION

LOADED = "loaded"
REASONS = ("in_host", "in_store", LOADED, "not_in_store", "checksum_failed", "layout_mismatch", "auth_failed",
           "timed_out", "ranks_disagreed", "host_pool_full", "queue_full", "cancelled", "store_unreachable",
           "earlier_page_missing", "earlier_page_failed", OLD_WEIGHT_VERSION, "dropped_under_lease",
           "error")  # fmt: skip
OUTCOMES_FORMAT = "hicache-outcomes-1"
#: Reasons that leave no trace in the store: only the controller's memory can give them.
TRANSIENT = frozenset({"timed_out", "ranks_disagreed", "host_pool_full", "queue_full", "cancelled",
                       "store_unreachable"})  # fmt: skip

_BY_STATUS = {
    PageStatus.OK: LOADED,
    PageStatus.MISSING: "not_in_store",
    PageStatus.CORRUPT: "checksum_failed",
    PageStatus.MISMATCH: "layout_mismatch",
    PageStatus.AUTH_FAILED: "auth_failed",
    PageStatus.TIMEOUT: "timed_out",
    PageStatus.CANCELLED: "cancelled",
}


def reason_of_status(status: PageStatus) -> str:
    """The reason code of a page read's status."""
    return _BY_STATUS.get(status, "error")


class Outcomes:
    """The last outcome of each page key, at most ``capacity`` keys (the oldest are forgotten first)."""

    def __init__(self, capacity: int = 65536) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._last: OrderedDict[str, tuple[str, str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, keys: Sequence[str], reason: str, detail: str = "") -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown reason {reason!r}; reasons: {', '.join(REASONS)}")
        if not keys:
            return
        now = time.time()
        with self._lock:
            for k in keys:
                self._last[k] = (reason, detail, now)
                self._last.move_to_end(k)
            while len(self._last) > self.capacity:
                self._last.popitem(last=False)

    def last(self, key: str) -> tuple[str, str, float] | None:
        with self._lock:
            return self._last.get(key)

    def last_counts(self, keys: Sequence[str]) -> dict[str, int]:
        with self._lock:
            return dict(Counter(self._last[k][0] for k in keys if k in self._last))

    def __len__(self) -> int:
        return len(self._last)

    def write(self, path: str | os.PathLike, *, namespace: str, rank: int, broken: str = "") -> Path:
        """Write this memory as JSON (atomically), tagged with its namespace and rank, for ``hicache explain-miss``."""
        path = Path(path)
        with self._lock:
            last = {k: list(v) for k, v in self._last.items()}
        doc = {"format": OUTCOMES_FORMAT, "namespace": namespace, "rank": rank, "broken": broken, "outcomes": last}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> tuple[Outcomes, dict[str, Any]]:
        """An :class:`Outcomes` from a file :meth:`write` wrote, and its tags (namespace, rank, broken).

        :raises ValueError: the file is not an outcomes file (each entry is checked).
        """
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not an outcomes file ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != OUTCOMES_FORMAT:
            raise ValueError(f"{path}: not an outcomes file (format {OUTCOMES_FORMAT!r} expected)")
        entries = doc.get("outcomes")
        if not isinstance(entries, dict):
            raise ValueError(f"{path}: 'outcomes' must map page keys to [reason, detail, time]")
        memory = cls(max(1, len(entries)))
        for key, entry in entries.items():
            if (not isinstance(entry, list) or len(entry) != 3 or entry[0] not in REASONS
                    or not isinstance(entry[1], str) or not isinstance(entry[2], (int, float))):  # fmt: skip
                raise ValueError(f"{path}: outcome of {key[:16]} is not [reason, detail, time]: {entry!r}")
            memory._last[key] = (entry[0], entry[1], float(entry[2]))
        tags = {"namespace": doc.get("namespace"), "rank": doc.get("rank"), "broken": doc.get("broken") or ""}
        if not isinstance(tags["namespace"], str) or not isinstance(tags["rank"], int) or \
                not isinstance(tags["broken"], str):  # fmt: skip
            raise ValueError(f"{path}: not an outcomes file (namespace, rank and broken must be text, int, text)")
        return memory, tags


@dataclass(frozen=True)
class PageExplanation:
    """One page: where it is, and the reason code (with a detail) for where it is not."""

    index: int
    key: str
    in_host: bool | None  # None: the caller did not say what its host tier holds
    in_store: bool | None  # None: the store could not be asked
    reason: str
    detail: str = ""
    last_outcome: str = ""  # the controller's memory of the last prefetch of this key, if any


@dataclass
class MissReport:
    """What :func:`explain_miss` found for one prefix, namespace and rank."""

    namespace: str
    rank: int
    pages: list[PageExplanation] = field(default_factory=list)
    broken: str = ""

    @property
    def hit_pages(self) -> int:
        """Leading pages a prefetch would serve now (from the host tier or the store)."""
        n = 0
        for p in self.pages:
            if p.reason not in ("in_host", "in_store", LOADED):
                break
            n += 1
        return n

    def reasons(self) -> dict[str, int]:
        return dict(Counter(p.reason for p in self.pages))

    def as_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "rank": self.rank, "broken": self.broken, "hit_pages": self.hit_pages,
                "reasons": self.reasons(), "pages": [asdict(p) for p in self.pages]}  # fmt: skip

    def format(self) -> str:
        lines = [f"namespace {self.namespace}, rank {self.rank}: {self.hit_pages} of {len(self.pages)} leading pages "
                 "would hit"]  # fmt: skip
        if self.broken:
            lines.append(f"L3 is off on this rank: {self.broken}")
        for p in self.pages:
            where = f"host={_tri(p.in_host)} store={_tri(p.in_store)}"
            detail = f": {p.detail}" if p.detail else ""
            lines.append(f"  page {p.index:4d} {p.key[:16]} {where:24s} {p.reason}{detail}")
        return "\n".join(lines)


def _tri(x: bool | None) -> str:
    return "?" if x is None else ("yes" if x else "no")


def other_layout_namespaces(storage: PageStore) -> list[tuple[str, Namespace]]:
    """The namespaces this pool's pages would have under every other registered layout (same model and share)."""
    pool, ns = storage.host_pool, storage.namespace
    registry = getattr(pool, "registry", None)
    layouts = getattr(registry, "layouts", None) or {}
    base = geometry_description(pool)
    out = []
    for name, decl in sorted(layouts.items()):
        if name == pool.spec.layout.name:
            continue
        desc = dict(base, layout=decl.name, layout_axes=list(decl.axes),
                    layout_decl=[repr(getattr(decl, f, None)) for f in ("split", "split_at", "merge", "merge_slots",
                                                                         "components")])  # fmt: skip
        out.append((name, Namespace(ns.model_id, fingerprint(desc), ns.share, ns.weight_version)))
    return out


def explain_miss(
    storage: PageStore,
    token_ids: Sequence[Any],
    *,
    prior_hash: str | None = None,
    host_pages: int | Sequence[bool] | None = None,
    outcomes: Outcomes | None = None,
    rank: int = 0,
    broken: str = "",
) -> MissReport:
    """Explain, page by page, where the pages of ``token_ids`` are and why the others are not.

    Reads the store (``exists`` for every page, a verification read of every present page into a
    scratch page: nothing in the host pool is touched) and the controller's ``outcomes``.
    Arguments are checked before the store is asked anything.
    """
    if storage.namespace is None:
        raise ValueError("explain_miss needs a bound store (make_storage(url, host_pool, model_id=...))")
    pool = storage.host_pool
    keys = check_keys(page_hashes(token_ids, pool.page_size, prior_hash)) if token_ids is not None else None
    if keys is None:
        raise TypeError("token_ids must be a sequence of token ids")
    in_host = _host_flags(host_pages, len(keys))
    full = storage.namespace.keys(keys)
    report = MissReport(storage.namespace.prefix, rank, broken=broken)
    try:
        present: list[bool | None] = []
        for start in range(0, len(full), 128):
            present += list(storage.backend.exists_objects(full[start : start + 128]))
        store_error = ""
    except Exception as exc:  # noqa: BLE001 - the report says so instead of raising
        present, store_error = [None] * len(keys), f"{type(exc).__name__}: {exc}"
    elsewhere: dict[int, str] = {}
    absent = [i for i, p in enumerate(present) if p is False]
    if absent:
        for name, other in other_layout_namespaces(storage):
            try:
                found = storage.backend.exists_objects([other.key(keys[i]) for i in absent])
            except Exception:  # noqa: BLE001 - best effort: the page stays not_in_store
                break
            for i, f in zip(absent, found):
                if f:
                    elsewhere.setdefault(i, name)
    first_gap = None
    for i, key in enumerate(keys):
        last = outcomes.last(key) if outcomes is not None else None
        last_reason = last[0] if last else ""
        reason, detail = "", ""
        if in_host[i]:
            reason = "in_host"
        elif present[i] is None:
            reason, detail = "store_unreachable", store_error
        elif present[i]:
            check = storage.check_page(key)
            if check.status is PageStatus.OK:
                reason = last_reason if last_reason in TRANSIENT else "in_store"
                detail = last[1] if reason in TRANSIENT else ""
            else:
                reason, detail = reason_of_status(check.status), check.detail
        elif i in elsewhere:
            reason = "layout_mismatch"
            detail = f"stored for layout {elsewhere[i]!r}, this pool is {pool.spec.layout.name!r}"
        elif (old := _old_version(storage, key)) is not None:
            reason = OLD_WEIGHT_VERSION
            detail = f"stored for weight version {old!r}; the server now serves {storage.weight_version!r}"
        elif (why := storage.why_dropped(key)) is not None:
            reason, detail = "dropped_under_lease", why
        else:
            reason = "not_in_store"
        if first_gap is not None and reason in ("in_store",):
            reason, detail = "earlier_page_missing", f"page {first_gap} of the prefix is not usable"
        if first_gap is None and reason not in ("in_host", "in_store", LOADED):
            first_gap = i
        report.pages.append(PageExplanation(i, key, in_host[i], present[i], reason, detail, last_reason))
    return report


def _old_version(storage: PageStore, key: str) -> str | None:
    try:
        return storage.old_weight_version_of(key)
    except Exception:  # noqa: BLE001 - best effort: the page stays not_in_store
        return None


def _host_flags(host_pages: int | Sequence[bool] | None, n: int) -> list[bool | None]:
    if host_pages is None:
        return [None] * n
    if isinstance(host_pages, bool):
        raise TypeError("host_pages is a count of leading pages or one bool per page, not a bool")
    if isinstance(host_pages, int):
        if not 0 <= host_pages <= n:
            raise ValueError(f"host_pages={host_pages} is not in [0, {n}] (the prefix has {n} whole pages)")
        return [i < host_pages for i in range(n)]
    flags = list(host_pages)
    if len(flags) != n or not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"host_pages must be {n} bools (one per whole page), got {flags!r}")
    return flags
