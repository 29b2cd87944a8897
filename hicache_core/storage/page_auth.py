"""The cluster's key, and the keyed MAC that authenticates every L3 page with it.

The instances of one cluster share a secret (``HICACHE_L3_KEY_FILE``: a file holding it; or
``HICACHE_L3_KEY``: the secret itself). With it set, every page a :class:`~hicache_core.storage.PageStore`
writes carries a 32-byte BLAKE3 keyed tag over its header, its full store key (namespace and page
hash) and its bytes (payload and checksum row), and a page is loaded only when its tag checks. A
page written without the key, with another key, changed after it was written, or copied under
another key is then a miss (``auth_failed``), never a load. The tag gives integrity and
authenticity, not confidentiality: whoever can read the store reads the bytes.

BLAKE3 was chosen by measurement (benchmarks/results/l3-mac-choice-cpu.json): keyed BLAKE3 tags
pages at 6 GB/s on one core of the development machine and scales with threads, against 1.7 GB/s
for HMAC-SHA256 (SHA-NI) and 0.9 GB/s for keyed BLAKE2b; AES-GMAC is faster on one core but needs a
nonce that no two pages of a cluster may share under one key, and does not scale with threads here.

The secret's bytes never show: not in ``repr``, errors, logs or pickles. What identifies a key is
its *key id*: 8 bytes derived from it one-way, stored in each keyed page's header, so a reader can
say "written with another key" without knowing that key.
"""

from __future__ import annotations

import ctypes
import hmac
import logging
import os
import stat
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from ..key_id import MIN_KEY_BYTES, key_id_of, short_key_message
from ..settings.variables import L3_KEY, L3_KEY_FILE

#: Read with ``Setting.read`` as text: the variables are validated here, by messages that never echo them.
KEY_FILE, KEY = L3_KEY_FILE, L3_KEY
ENV_KEY_FILE, ENV_KEY = KEY_FILE.name, KEY.name
TAG_BYTES = 32
_MAX_KEY_FILE = 1 << 16
#: ``PageStore(cluster_key=...)``'s default: read the key from the environment.
FROM_ENVIRONMENT: Literal["environment"] = "environment"

# BLAKE3's key derivation contexts: the page MAC key, the record MAC key and the key id (its context is
# in hicache_core.key_id) never equal each other or any other use of the same secret.
_MAC_CONTEXT = "hicache 2026-12 L3 page MAC v1"
_RECORD_CONTEXT = "hicache 2026-12 directory record MAC v1"
_SEAL_CONTEXT = "hicache 2026-12 directory record cipher v1"
_NONCE_BYTES = 12

#: The storage package's logger: a store bound without a key says so here, once per URL.
log = logging.getLogger("hicache_core.storage")
_WARNED_UNKEYED: set[str] = set()
_WARNED_LOCK = threading.Lock()


class ClusterKeyError(ValueError):
    """The cluster key's configuration is wrong (the message names the variable or file, never the key)."""


def _blake3():
    try:
        import blake3
    except ImportError:  # hicache-core depends on blake3; a stripped install says what is missing
        raise ImportError(
            "a cluster key is set but the blake3 package is missing: pip install blake3 (hicache-core depends on it)"
        ) from None
    return blake3


class ClusterKey:
    """The key the instances of a cluster share; tags and checks L3 pages.

    :param material: the secret, at least :data:`MIN_KEY_BYTES` bytes (whitespace at its ends is
        not part of it, so a file written by ``echo`` works).
    :param source: where it came from, for messages (a variable's name or a file's path; never the key).

    Only four values derived one-way from the secret are kept: the page MAC key, the record MAC key
    (directory entries, :meth:`record_tag`), the record cipher key (:meth:`seal`) and the key id.
    """

    __slots__ = ("_mac_key", "_record_key", "_seal_key", "_hasher", "key_id", "source")

    def __init__(self, material: bytes, source: str = "the caller") -> None:
        if not isinstance(material, (bytes, bytearray)):
            raise TypeError(f"the cluster key from {source} must be bytes, got {type(material).__name__}")
        material = bytes(material).strip()
        if len(material) < MIN_KEY_BYTES:
            raise ClusterKeyError(short_key_message(source, len(material)))
        blake3 = _blake3()
        self._mac_key = blake3.blake3(material, derive_key_context=_MAC_CONTEXT).digest()
        self._record_key = blake3.blake3(material, derive_key_context=_RECORD_CONTEXT).digest()
        self._seal_key = blake3.blake3(material, derive_key_context=_SEAL_CONTEXT).digest()
        self._hasher = blake3.blake3
        #: 8 bytes that name the key (in every keyed page's header); they tell nothing of the key.
        self.key_id: bytes = key_id_of(material)
        self.source = source

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ClusterKey | None:
        """The key ``HICACHE_L3_KEY_FILE`` or ``HICACHE_L3_KEY`` holds; ``None`` when neither is set.

        :raises ClusterKeyError: both are set, the file cannot be read, others may read it, or the key
            is shorter than :data:`MIN_KEY_BYTES`.
        """
        env = os.environ if environ is None else environ
        path, value = KEY_FILE.read(env), KEY.read(env)
        if path is not None and value is not None:
            raise ClusterKeyError(f"both {ENV_KEY_FILE} and {ENV_KEY} are set: set one (the file is safer)")
        if value is not None:
            return cls(value.encode("utf-8", "surrogateescape"), ENV_KEY)
        if path is not None:
            return cls.from_file(path)
        return None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ClusterKey:
        """The key a file holds. A file that others (not owner, not group) may read is refused."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if not stat.S_ISREG(mode):
                    raise ClusterKeyError(f"cluster key file {path} is not a regular file")
                if mode & stat.S_IRWXO:
                    raise ClusterKeyError(
                        f"cluster key file {path} may be read or written by any user (mode {stat.filemode(mode)}): "
                        f"chmod o-rwx {path}"
                    )
                material = f.read(_MAX_KEY_FILE + 1)
        except OSError as exc:
            raise ClusterKeyError(f"cannot read the cluster key file {path} ({ENV_KEY_FILE}): "
                                  f"{exc.strerror or type(exc).__name__}") from None  # fmt: skip
        if len(material) > _MAX_KEY_FILE:
            raise ClusterKeyError(f"cluster key file {path} is over {_MAX_KEY_FILE} bytes: not a key file")
        return cls(material, str(path))

    def tag(self, header_prefix: bytes | bytearray | memoryview, full_key: str,
            runs: Sequence[tuple[int, int]]) -> bytes:  # fmt: skip
        """The page's tag: keyed BLAKE3 over the header's first bytes, the full key, then the memory runs.

        The key is length-prefixed, so no header, key and payload split the same bytes two ways.
        """
        key = full_key.encode("utf-8", "surrogatepass")
        h = self._hasher(bytes(header_prefix) + struct.pack("<I", len(key)) + key, key=self._mac_key)
        for ptr, n in runs:
            if n:
                h.update(memoryview((ctypes.c_char * n).from_address(ptr)).cast("B"))
        return h.digest()

    def record_tag(self, kind: str, *fields: bytes | str) -> bytes:
        """A tag over a small record (a directory entry, an owner record) under the record key.

        ``kind`` names the record's type and every field is length-prefixed, so a record of one kind
        or one field split never checks as another. Its key is not the page MAC's: a page tag is never
        a valid record tag, nor the reverse.
        """
        h = self._hasher(key=self._record_key)
        for part in (kind, *fields):
            raw = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else bytes(part)
            h.update(struct.pack("<I", len(raw)))
            h.update(raw)
        return h.digest()

    def seal(self, kind: str, secret: bytes, *bound: bytes | str) -> bytes:
        """``secret`` encrypted and authenticated (ChaCha20-Poly1305, a random nonce) for the cluster only.

        ``kind`` and ``bound`` (e.g. the record's owner and directory prefix) are authenticated, not
        encrypted: the sealed bytes open only with the same ones. Needs the ``cryptography`` package.
        """
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + _aead(self._seal_key).encrypt(nonce, bytes(secret), _bound(kind, bound))

    def open(self, kind: str, sealed: bytes, *bound: bytes | str) -> bytes | None:
        """What :meth:`seal` sealed, or ``None``: another key, other ``kind``/``bound``, or changed bytes."""
        if len(sealed) < _NONCE_BYTES + 16:
            return None
        from cryptography.exceptions import InvalidTag

        try:
            return _aead(self._seal_key).decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], _bound(kind, bound))
        except InvalidTag:
            return None

    def verify(self, tag: bytes, expected: bytes) -> bool:
        """Whether two tags are equal, in time that does not depend on where they differ."""
        return hmac.compare_digest(tag, expected)

    def __repr__(self) -> str:
        return f"<ClusterKey id={self.key_id.hex()} from {self.source}>"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a ClusterKey is not pickled: each process reads the key from its own environment or file")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterKey) and hmac.compare_digest(self._mac_key, other._mac_key)

    def __hash__(self) -> int:
        return hash(self.key_id)


def _aead(key: bytes):
    try:
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    except ImportError:
        raise ImportError(
            "sealing a directory record needs the cryptography package: pip install cryptography"
        ) from None
    return ChaCha20Poly1305(key)


def _bound(kind: str, bound: Sequence[bytes | str]) -> bytes:
    out = bytearray()
    for part in (kind, *bound):
        raw = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else bytes(part)
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def resolve_key(cluster_key: ClusterKey | None | str) -> ClusterKey | None:
    """``cluster_key`` as a :class:`ClusterKey` or ``None``: :data:`FROM_ENVIRONMENT` reads the environment."""
    if isinstance(cluster_key, str) and cluster_key == FROM_ENVIRONMENT:
        return ClusterKey.from_environment()
    if cluster_key is None or isinstance(cluster_key, ClusterKey):
        return cluster_key
    raise TypeError(
        f"cluster_key must be a ClusterKey, None or {FROM_ENVIRONMENT!r}, got {type(cluster_key).__name__}"
        " (a key as text or bytes goes through ClusterKey(...), so its source shows, never its bytes)"
    )


def warn_unauthenticated(backend: Any) -> None:
    """Log one WARNING per process and store URL (its password hidden) that its pages carry no MAC.

    Called when a page store is bound to a host pool without a key (none in the environment, or
    ``cluster_key=None``). Not for the core's ``memory://``: its pages live in this process, so nothing
    outside it can plant one. Every other store is written by others: a server, a bucket, a directory
    whose permissions may let other accounts in (``file://``); and a plugin that leaves
    ``Capabilities.shared`` at its default is no proof that it is private.

    :param backend: the store's :class:`~hicache_core.storage.StorageBackend`.
    """
    # By scheme, not by class: the registry gives "memory" to the core's store only (a plugin's is refused),
    # and importing memory.py here would close an import cycle through backend.py.
    if backend.scheme == "memory" and not backend.capabilities.shared:
        return
    url = backend.url.redacted
    with _WARNED_LOCK:
        if url in _WARNED_UNKEYED:
            return
        _WARNED_UNKEYED.add(url)
    log.warning(
        "L3 store %s is UNAUTHENTICATED (no cluster key: %s and %s are unset, or cluster_key=None): its pages are "
        "written and read without a MAC, so anyone who can write the store can plant pages that this instance "
        "loads. Set %s to a file holding the cluster's key (openssl rand -hex 32 > FILE && chmod 600 FILE) on "
        "every instance; docs/security.md says what it protects.",
        url, ENV_KEY_FILE, ENV_KEY, ENV_KEY_FILE,
    )  # fmt: skip
