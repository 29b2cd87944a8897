"""What may be said of the cluster's L3 key without saying it: its key id, and whether it is long enough.

Apart from :mod:`hicache_core.storage.page_auth`, which uses both, because :mod:`hicache_core.settings.variables`
shows ``HICACHE_L3_KEY`` by its id in ``hicache settings``, and an import of the storage package from
there would close an import circle (the storage package reads its settings from ``variables``).
"""

from __future__ import annotations

#: The least key material taken: 32 bytes, e.g. ``openssl rand -hex 32`` (64 characters).
MIN_KEY_BYTES = 32
# A BLAKE3 key derivation context of its own: the key id never equals a MAC or cipher key of the same secret.
_ID_CONTEXT = "hicache 2026-12 L3 key id v1"


def key_id_of(material: bytes) -> bytes:
    """The 8-byte key id of ``material`` (the key, stripped): derived one-way, it tells nothing of the key.

    :raises ImportError: the blake3 package is missing.
    """
    import blake3

    return blake3.blake3(material, derive_key_context=_ID_CONTEXT).digest(8)


def short_key_message(source: str, length: int) -> str:
    """Why a key of ``length`` bytes from ``source`` (a variable's name or a file's path) is refused."""
    return (f"the cluster key from {source} is {length} bytes; it must be at least {MIN_KEY_BYTES} "
            "(make one with: openssl rand -hex 32)")  # fmt: skip
