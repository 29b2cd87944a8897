"""Which tier a store is, as a router sees it: its kind, its locality, and the store's identity."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

__all__ = ["Tier", "tier_of"]

#: Tier kinds, fastest first: a router weighs a hit by the tier's kind and by its measured load cost.
KINDS = ("host", "peer", "disk", "shared", "object")


@dataclass(frozen=True)
class Tier:
    """One tier an event names.

    :param kind: ``host`` (this instance's host pool), ``peer`` (this instance's host pool, served to
        other instances), ``disk`` (a store on this machine), ``shared`` (a store other machines reach:
        Redis, Mooncake), ``object`` (an object store).
    :param store: the store's identity, the same in every instance that reaches it, so a router knows
        that any of them can load a page it holds; never a secret (no password, no query).
    :param locality: ``LOCAL`` or ``REMOTE`` from the publisher's side (vLLM's ``locality``).
    """

    kind: str
    store: str
    locality: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a tier's kind is one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.locality not in ("LOCAL", "REMOTE"):
            raise ValueError(f"a tier's locality is LOCAL or REMOTE, not {self.locality!r}")


def tier_of(backend: Any, store_id: str | None = None) -> Tier:
    """The tier a storage backend is: from its scheme and declared capabilities.

    ``store_id`` names the store where the default would not be the same in every instance (a shared
    file system mounted at different paths, a server reached by different host names). The default:
    a backend's own ``event_store_id`` where it has one (``peer://``: its owner), else its redacted URL
    with neither user, password nor query, and this machine's name for a local directory.
    """
    url = backend.url
    scheme = url.scheme
    caps = type(backend).capabilities
    if scheme == "peer":
        kind, locality = "peer", "LOCAL"
    elif scheme == "file":
        kind, locality = "disk", "LOCAL"
    elif scheme in ("s3", "gs", "az"):
        kind, locality = "object", "REMOTE"
    elif caps.shared:
        kind, locality = "shared", "REMOTE"
    else:
        kind, locality = "disk", "LOCAL"
    if store_id is None:
        store_id = getattr(backend, "event_store_id", None)
    if store_id is None:  # no user, password or query: nothing a listener may not read
        netloc = url.host or (socket.gethostname() if scheme == "file" else "")
        if url.port:
            netloc += f":{url.port}"
        store_id = f"{scheme}://{netloc}{url.path}"
    return Tier(kind, store_id, locality)
