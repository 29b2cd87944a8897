"""Storage URLs, their redaction, and the option parsers of every storage plugin (a leaf: no core import)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

#: Options (URL query or keyword) whose values are secrets: never printed (see :func:`redact_text`).
#: ``key_id`` (an S3 access key id) names the account a secret signs for: shown nowhere either.
SECRET_OPTIONS = frozenset({"password", "passwd", "pass", "token", "secret", "auth", "key_id"})

_OPTION_NAMES = "|".join(sorted(SECRET_OPTIONS, key=len, reverse=True))
#: ``password=value``, ``password: value``, ``'password': 'value'`` (a dict's repr), ``?token=value&``.
_SECRET_OPTION = re.compile(
    r"(?i)(?<![A-Za-z0-9_])((?:" + _OPTION_NAMES + r")['\"]?\s*[=:]\s*)('[^']*'|\"[^\"]*\"|[^&\s'\"#,;)}\]]*)"
)
#: A URL's user-info anywhere in a text: ``scheme://user:password@``, up to the netloc's last ``@``.
_USERINFO = re.compile(r"(?i)([a-z][a-z0-9+.-]*://)([^\s/?#'\"@]*(?:@[^\s/?#'\"@]*)*)@")
#: A literal secret shorter than this is left to the patterns above: replacing every "ab" would garble the text.
_MIN_LITERAL = 3


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every credential replaced by ``***``: what a message, log line or label may show.

    Replaced: the password of any URL's user-info in the text (``scheme://user:***@host``), the
    value of every secret option (:data:`SECRET_OPTIONS`, as ``name=value``, ``name: value`` or a
    dict's ``'name': 'value'``), and every occurrence of each literal in ``secrets`` (the values a
    backend was given, so a driver's message that repeats one in another form is caught too).
    """
    if not isinstance(text, str):
        text = str(text)
    for secret in sorted({s for s in secrets if isinstance(s, str) and len(s) >= _MIN_LITERAL}, key=len, reverse=True):
        text = text.replace(secret, "***")

    def userinfo(match: re.Match) -> str:
        user, colon, _ = match.group(2).partition(":")
        return f"{match.group(1)}{user}{':***' if colon else ''}@"

    text = _USERINFO.sub(userinfo, text)
    return _SECRET_OPTION.sub(lambda m: m.group(1) + ("'***'" if m.group(2)[:1] == "'" else
                                                       '"***"' if m.group(2)[:1] == '"' else "***"), text)  # fmt: skip


def redact_url(url: str) -> str:
    """``url`` with the user-info password and secret query values replaced by ``***`` (for messages)."""
    if not isinstance(url, str):
        return type(url).__name__
    return redact_text(url)


def secrets_of(url: StorageURL | None, options: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The secret values in a storage URL and a backend's options (to redact them wherever they show)."""
    found = list(url.secrets) if url is not None else []
    for name, value in (options or {}).items():
        if name.lower() in SECRET_OPTIONS and value is not None and str(value):
            found.append(str(value))
    return tuple(dict.fromkeys(found))


def scrub_exception(exc: BaseException, secrets: Iterable[str] = ()) -> BaseException:
    """Redact ``exc`` in place (its arguments, notes, and the exceptions it chains to); returns it.

    Every exception that leaves a storage backend passes through here (the
    :class:`~hicache_core.storage.StorageBackend` base class and :func:`make_storage` do it),
    so a plugin, or the driver it calls, that puts a password into a message never shows it.
    """
    secrets = tuple(secrets)
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        try:
            current.args = tuple(redact_text(a, secrets) if isinstance(a, str) else a for a in current.args)
        except (AttributeError, TypeError):  # an exception class with read-only args: its text is checked below
            pass
        if isinstance(current, OSError):
            for attr in ("filename", "filename2", "strerror"):
                value = getattr(current, attr, None)
                if isinstance(value, str):
                    setattr(current, attr, redact_text(value, secrets))
        notes = getattr(current, "__notes__", None)
        if isinstance(notes, list):
            current.__notes__ = [redact_text(n, secrets) if isinstance(n, str) else n for n in notes]
        todo += [current.__cause__, current.__context__]
    return exc


def parse_query(query: str) -> dict[str, str]:
    """A URL's ``name=value&...`` options, each percent-decoded; a literal ``+`` stays a ``+``.

    A storage URL is not a submitted form: a secret such as an S3 secret key holds ``+`` and ``/``
    as they are, and reading ``+`` as a space (``parse_qsl``) would silently change it. ``%2B``,
    ``%2F`` and ``%20`` decode to ``+``, ``/`` and a space.
    """
    out: dict[str, str] = {}
    for item in query.split("&"):
        if item:
            name, _, value = item.partition("=")
            out[unquote(name)] = unquote(value)
    return out


@dataclass(frozen=True)
class StorageURL:
    """A parsed storage URL: ``scheme://[user[:password]@][host[:port]]/path?option=value&...``.

    ``repr`` and :attr:`redacted` never show a password (user-info or ``?password=``).
    """

    raw: str = field(repr=False)
    scheme: str
    host: str | None
    port: int | None
    path: str
    query: dict[str, str] = field(default_factory=dict, repr=False)
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    @property
    def secrets(self) -> tuple[str, ...]:
        """The secret values this URL carries: the user-info password and secret query values."""
        found = [self.password] if self.password else []
        found += [v for k, v in self.query.items() if k.lower() in SECRET_OPTIONS and v]
        return tuple(found)

    @property
    def redacted(self) -> str:
        """The URL as it may be printed: secrets replaced by ``***``."""
        return redact_url(self.raw)

    def __repr__(self) -> str:
        return f"StorageURL({self.redacted!r})"

    @classmethod
    def parse(cls, url: str) -> StorageURL:
        if not isinstance(url, str) or "://" not in url:
            shown = redact_url(url) if isinstance(url, str) else type(url).__name__
            raise ValueError(
                f"a storage URL looks like file:///path, redis://host:port/db or mooncake://host:port; got {shown!r}"
            )
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"bad port in storage URL {redact_url(url)!r}: {redact_url(str(exc))}") from None
        query = parse_query(parts.query)
        user = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password is not None else None
        return cls(url, parts.scheme.lower(), parts.hostname, port, unquote(parts.path), query, user, password)


def option_bool(value: Any, name: str) -> bool:
    """A boolean option from a URL query string or a keyword (``1/0``, ``true/false``, ``yes/no``, ``on/off``)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"option {name}={value!r} is not a boolean (use 1/0, true/false)")


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip


def option_bytes(value: Any, name: str) -> int:
    """A size option: an int, or text like ``512MiB``, ``10GB``, ``4096``."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, ""
    else:
        text = str(value).strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        number, unit = digits, text[len(digits) :]
    try:
        out = int(float(number) * _UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(f"option {name}={value!r} is not a size (e.g. 4096, 512MiB, 10GB)") from None
    if out < 0:
        raise ValueError(f"option {name}={value!r} must not be negative")
    return out


def option_float(value: Any, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={value!r} is not a number") from None
