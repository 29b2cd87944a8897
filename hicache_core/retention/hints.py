"""A request's retention hints, as any server receives them: a lease to grant, a session, a supersede.

Servers carry them in their own envelopes (vLLM's ``kv_transfer_params`` and ``kv_hints``, SGLang's
request fields); each adapter takes them out and hands the mapping here, so every server reads the same
fields the same way::

    {"priority": 90, "ttl": "10m", "session": "agent-7", "supersede": false}

* ``ttl`` asks for a lease (seconds, or ``"30s"``, ``"5m"``, ``"1h"``: :func:`~hicache_core.retention.parse_ttl`);
  ``priority`` (0 to 100) is its weight, :data:`DEFAULT_PRIORITY` when not given. A ``priority`` without a
  ``ttl`` is refused: every lease has an end, and it is the sender's to choose.
* ``session`` names the conversation: a new request of it keeps the session's leases alive.
* ``supersede``: the session's earlier leases go first (its earlier state is not coming back).

Dynamo's (and Anthropic's) ``cache_control`` (``{"type": "ephemeral", "ttl": "5m"}``) asks for the same
lease; it may come beside a mapping that only names the session. Parsing is strict: an unknown field, a
wrong type, or two sources asking for a lease at once is a ``ValueError`` naming it, raised before any
page is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .lease import CACHE_CONTROL_PRIORITY, Retain, retain_from_cache_control

__all__ = ["DEFAULT_PRIORITY", "HINT_FIELDS", "RetentionHints", "hints_from_mapping"]

#: The fields of a hint mapping.
HINT_FIELDS = ("priority", "ttl", "session", "supersede")
#: A lease's priority when the hint gives a ``ttl`` and no ``priority`` (as a ``cache_control`` TTL).
DEFAULT_PRIORITY = CACHE_CONTROL_PRIORITY


@dataclass(frozen=True)
class RetentionHints:
    """What one request asks of the tiers' leases.

    ``retain``: the lease to grant on the request's pages (``None``: none); ``supersede``: the session's
    earlier leases go first; ``session``: the conversation the request belongs to (also ``retain.session``).
    """

    retain: Retain | None = None
    supersede: bool = False
    session: str | None = None

    def __post_init__(self) -> None:
        if self.retain is not None and self.retain.session != self.session:
            raise ValueError(f"a hint's lease is of session {self.retain.session!r}, the hint of {self.session!r}")
        if self.supersede and self.session is None:
            raise ValueError("supersede needs the session whose earlier leases it supersedes")

    def __bool__(self) -> bool:
        return self.retain is not None or self.supersede or self.session is not None


def hints_from_mapping(mapping: Mapping[str, Any] | None, *, cache_control: Any = None,
                       where: str = "hicache") -> RetentionHints:  # fmt: skip
    """Read one request's hints: ``mapping`` (the fields of :data:`HINT_FIELDS`) and/or ``cache_control``.

    ``where`` names the mapping in messages (``"kv_transfer_params['hicache']"``). Both ``None``: no hints.
    Raises ``ValueError`` naming the field for an unknown field, a wrong type or value, and for a lease asked
    twice (a ``ttl`` in ``mapping`` beside a ``cache_control``).
    """
    fields: Mapping[str, Any] = {}
    if mapping is not None:
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{where} is an object with fields {', '.join(HINT_FIELDS)}; got {type(mapping).__name__}")
        unknown = sorted(str(k) for k in mapping if k not in HINT_FIELDS)
        if unknown:
            raise ValueError(f"{where} has fields hicache does not know: {', '.join(unknown)} "
                             f"(known: {', '.join(HINT_FIELDS)})")  # fmt: skip
        fields = mapping
    session = fields.get("session")
    if session is not None and (not isinstance(session, str) or not session or len(session) > 256):
        raise ValueError(f"{where}.session is a non-empty text of at most 256 characters, got {session!r}")
    supersede = fields.get("supersede", False)
    if not isinstance(supersede, bool):
        raise ValueError(f"{where}.supersede is true or false, got {supersede!r}")
    if supersede and session is None:
        raise ValueError(f"{where}.supersede needs {where}.session: the session whose earlier leases it supersedes")
    asks = "ttl" in fields or "priority" in fields
    if asks and cache_control is not None:
        raise ValueError(f"a lease is asked twice: by {where} (ttl/priority) and by cache_control; give one")
    retain = None
    if asks:
        if "ttl" not in fields:
            raise ValueError(f"{where}.priority needs {where}.ttl: every lease has an end")
        priority = fields.get("priority", DEFAULT_PRIORITY)
        try:
            retain = Retain(priority=priority, ttl_s=fields["ttl"], session=session)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    elif cache_control is not None:
        try:
            retain = retain_from_cache_control(cache_control, session=session)
        except ValueError as exc:
            raise ValueError(f"cache_control: {exc}") from None
    return RetentionHints(retain=retain, supersede=supersede, session=session)
