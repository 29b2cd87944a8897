"""Page keys: SGLang's SHA-256 chain over token ids, inside a namespace of model, geometry and rank share.

A page's hash covers its own tokens and, through the previous page's hash, every token
before it, so one key names a whole prefix and ``batch_exists`` can answer "how many
leading pages are stored". The chain is SGLang's (``get_hash_str``): SHA-256 over the
previous hash's raw 32 bytes, then each token id as 4 little-endian bytes (each element
of a tuple token, as EAGLE bigrams are). A hicache key is ``<namespace>/<page hash>``, so
the hash part equals SGLang's for the same tokens.

The namespace keeps pages that cannot be loaded into a pool apart from the pages that
can: a different model, a different pool geometry (kind, layout, dtype, item bytes,
page size, layers per page) or a different share of the model (tensor-parallel rank,
layer shard) is a different namespace, so it is never even found. The model part is a
readable, path-safe abbreviation of the model id followed by SHA-256 of the *exact* id, so
``run/checkpoint-1000`` and ``run/checkpoint-2000``, or ``acme/llama`` and ``acme_llama``,
never share a page (the readable part alone would fold them together).

A *weight version* (set by the server, and changed when it updates its weights in place) is part
of the namespace too: pages computed with other weights are other keys, never found. An empty
weight version leaves the prefix as it was before versions existed.
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

#: Bumped when the namespace description changes meaning; part of every fingerprint and every prefix.
#: 2: the prefix carries SHA-256 of the exact model id (version 1 kept only a folded 80-character prefix).
NAMESPACE_VERSION = 2
_LAYOUT_FIELDS = ("split", "split_at", "merge", "merge_slots", "components")
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _token_id(x: Any) -> int:
    """An integer token id; a float, a string or a bool is refused, never coerced (``1.5`` is not ``1``)."""
    if isinstance(x, bool):
        raise TypeError(f"token id {x!r} is a bool, not an integer")
    try:
        return operator.index(x)  # int, numpy and torch integer scalars; not float, str, float tensors
    except TypeError:
        kind = type(x).__name__
        raise TypeError(f"token id {x!r} ({kind}) is not an integer (token ids are never coerced)") from None


def _token_bytes(tokens: Sequence[Any]) -> bytes:
    flat: list[int] = []
    for t in tokens:
        if isinstance(t, (tuple, list)):
            flat.extend(_token_id(x) for x in t)
        else:
            flat.append(_token_id(t))
    try:
        return struct.pack(f"<{len(flat)}I", *flat)
    except struct.error:
        bad = next(x for x in flat if not 0 <= x < 2**32)
        raise ValueError(f"token id {bad} does not fit in 4 unsigned bytes (the key chain hashes uint32)") from None


def hash_page(tokens: Sequence[Any], prior_hash: str | None = None) -> str:
    """SHA-256 hex of one page of token ids chained onto ``prior_hash`` (SGLang's ``get_hash_str``)."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    hasher.update(_token_bytes(tokens))
    return hasher.hexdigest()


def page_hashes(token_ids: Sequence[Any], page_size: int, prior_hash: str | None = None) -> list[str]:
    """One chained hash per whole page of ``token_ids``; a trailing partial page gets none.

    ``prior_hash`` is the hash of the page before ``token_ids[0]`` (a server that keys a
    suffix of a cached prefix passes the prefix's last hash).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    out: list[str] = []
    last = prior_hash
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        last = hash_page(token_ids[start : start + page_size], last)
        out.append(last)
    return out


def geometry_description(host_pool: Any) -> dict[str, Any]:
    """What a stored page's bytes depend on: the pool kind, the layout declaration, dtype and sizes."""
    geometry = host_pool.geometry
    layout = host_pool.spec.layout
    return {
        "version": NAMESPACE_VERSION,
        "pool_kind": geometry.kind,
        "layout": layout.name,
        "layout_axes": list(layout.axes),
        # whatever else the declaration says about placement (split parts, merged axes, components)
        # split_at left the declaration in 0.2.0; it stays None here so that stored pages keep their keys.
        "layout_decl": [repr(None if f == "split_at" else getattr(layout, f, None)) for f in _LAYOUT_FIELDS],
        "dtype": str(geometry.dtype).replace("torch.", ""),
        "item_bytes": list(geometry.item_bytes),
        "page_size": geometry.page_size,
        "layers_per_page": geometry.host_layers,
        "draft_layers": geometry.draft_layers,
        "extras": [list(e) for e in geometry.extras],
    }


def model_digest(model_id: str) -> str:
    """``m<NAMESPACE_VERSION>-`` and 24 hex digits (96 bits) of SHA-256 over the exact model id's UTF-8 bytes."""
    return f"m{NAMESPACE_VERSION}-" + hashlib.sha256(model_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def weight_part(weight_version: str) -> str:
    """``w-<readable version, 24 characters at most>-<16 hex digits of SHA-256 of the exact version>``."""
    readable = _SAFE.sub("_", weight_version).strip("._")[:24] or "v"
    return f"w-{readable}-" + hashlib.sha256(weight_version.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def fingerprint(description: dict[str, Any]) -> str:
    """16 bytes (32 hex digits) of SHA-256 over a canonical JSON of ``description``."""
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Namespace:
    """Where a host pool's pages live in a store: model id, geometry fingerprint, this rank's share.

    :param model_id: the model's name, exactly (any string): the prefix holds a path-safe
        abbreviation of it and SHA-256 of all of it.
    :param fingerprint: :func:`fingerprint` of the pool geometry (32 hex digits).
    :param share: this rank's part of the model, e.g. ``tp1of4`` or ``replicated``, plus a
        layer shard ``-L16-32of61`` where the pool owns only some layers.
    :param weight_version: which weights the pages were computed with (any string the server
        names them by; ``""``: unversioned, the prefix has no weight part).
    """

    model_id: str
    fingerprint: str
    share: str
    weight_version: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.weight_version, str):
            raise TypeError(f"weight_version must be a str, got {type(self.weight_version).__name__}")

    @property
    def prefix(self) -> str:
        """``<readable model>.<model digest>[.<weights>].<fingerprint>.<share>``.

        e.g. ``acme_llama.m2-3f2a....<fp>.tp0of1``; with a weight version ``v7``,
        ``acme_llama.m2-3f2a....w-v7-<16 hex>.<fp>.tp0of1`` (:func:`weight_part`).
        """
        model = _SAFE.sub("_", self.model_id).strip("._") or "model"
        weights = f".{weight_part(self.weight_version)}" if self.weight_version else ""
        return f"{model[:48]}.{model_digest(self.model_id)}{weights}.{self.fingerprint}.{self.share}"

    def with_weight_version(self, weight_version: str) -> Namespace:
        """The same namespace for pages computed with the weights ``weight_version`` names."""
        return replace(self, weight_version=weight_version)

    def key(self, page_hash: str) -> str:
        """The store key of one page hash."""
        return f"{self.prefix}/{page_hash}"

    def keys(self, page_hashes: Iterable[str]) -> list[str]:
        prefix = self.prefix
        return [f"{prefix}/{h}" for h in page_hashes]


def rank_share(
    *, tp_rank: int = 0, tp_size: int = 1, replicated: bool = False, layer_range: tuple[int, int, int] | None = None
) -> str:
    """The share string of a rank: ``tp<rank>of<size>`` (or ``replicated``), plus ``-L<start>-<end>of<n>``.

    :param replicated: every TP rank holds the same bytes (MLA): one copy serves all ranks.
    :param layer_range: ``(start, end, layer_num)`` when the pool owns only layers ``[start, end)``.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
    share = "replicated" if replicated else f"tp{tp_rank}of{tp_size}"
    if layer_range is not None:
        start, end, num = layer_range
        if (start, end) != (0, num):
            share += f"-L{start}-{end}of{num}"
    return share


def namespace_for(
    host_pool: Any,
    model_id: str,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    replicated: bool | None = None,
    weight_version: str = "",
) -> Namespace:
    """The namespace of ``host_pool``'s pages for ``model_id`` (and ``weight_version``) on this rank.

    ``replicated`` defaults to the pool kind's ``rank_replicated`` declaration (true for MLA: every
    TP rank holds the whole latent cache).
    """
    if not isinstance(model_id, str) or not model_id:
        raise ValueError("model_id must be a non-empty string (pages of different models must never mix)")
    geometry = host_pool.geometry
    if replicated is None:
        replicated = geometry.decl is not None and geometry.decl.rank_replicated
    share = rank_share(
        tp_rank=tp_rank,
        tp_size=tp_size,
        replicated=replicated,
        layer_range=(geometry.start_layer, geometry.end_layer, geometry.layer_num),
    )
    return Namespace(model_id, fingerprint(geometry_description(host_pool)), share, weight_version)
