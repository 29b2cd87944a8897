"""Where an ``s3://`` backend finds its endpoint, region and credentials, as AWS users expect.

Credentials: the URL's ``key_id=``/``secret=``/``token=`` when given; otherwise AWS's standard provider
chain, through botocore (the AWS SDK's own resolver), which obstore takes as a credential provider
(``obstore.auth.boto3``): the environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``), the shared credentials and config files with profiles (static keys, assumed
roles, SSO, ``credential_process``), web identity tokens (``AWS_WEB_IDENTITY_TOKEN_FILE``), container
roles (ECS/EKS) and EC2 instance roles. Temporary credentials are refreshed by botocore before they
expire; obstore asks again every ``refresh`` seconds. A ``?profile=`` in the URL is an explicit choice:
it wins over the environment's keys (as in the AWS CLI).

Why botocore's chain rather than object_store's own (web identity, container and instance roles, in
Rust): object_store reads neither profiles nor their roles, SSO or ``credential_process``, and its
credentials never reach Python, where the multipart client (:mod:`.multipart`) must sign with the same
ones. :class:`Credentials` is obstore's ``credential_provider`` contract over that chain, as
``obstore.auth.boto3.Boto3CredentialProvider`` is, without importing boto3 (three more packages) and
keeping every part it handed out, which scrubbing needs.

Region: ``?region=``, ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile's, else ``us-east-1``.
Endpoint: ``?endpoint=``, ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the profile's ``endpoint_url``,
else AWS itself.

No credential part leaves this module in text: :class:`Credentials` prints only where they came from,
and :meth:`Credentials.scrub` removes every part it ever handed out (key id, secret, token) from a
message before it is shown.
"""

from __future__ import annotations

import configparser
import os
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

#: botocore's names for where its credentials came from, as ``credentials_from`` shows them.
_METHODS = {"env": "environment", "shared-credentials-file": "profile", "config-file": "profile",
            "assume-role": "assumed role", "assume-role-with-web-identity": "web identity",
            "container-role": "container role", "iam-role": "instance role", "sso": "SSO",
            "custom-process": "credential_process"}  # fmt: skip


class Credentials:
    """What signs the requests: fixed parts (from the URL) or AWS's provider chain; ``repr`` shows only ``source``.

    Call it (obstore's ``credential_provider``) for the current parts; :meth:`scrub` hides every part
    ever handed out, so a message about a request signed before a refresh is clean too.
    """

    def __init__(self, source: str, *, fixed: tuple[str, str, str | None] | None = None, chain: Any = None,
                 refresh_s: float = 60.0) -> None:  # fmt: skip
        if (fixed is None) == (chain is None):
            raise ValueError("Credentials take fixed parts or a chain, one of the two")
        self.source = source
        self._fixed = fixed
        self._chain = chain
        self._refresh = timedelta(seconds=refresh_s)
        self._seen: set[str] = {p for p in (fixed or ()) if p}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Credentials(source={self.source!r})"

    __str__ = __repr__

    def current(self) -> tuple[str, str, str | None]:
        """The key id, secret and session token to sign with now (the chain refreshes them when due)."""
        if self._fixed is not None:
            return self._fixed
        frozen = self._chain.get_frozen_credentials()
        parts = (frozen.access_key, frozen.secret_key, frozen.token or None)
        with self._lock:
            self._seen.update(p for p in parts if p)
        return parts

    def __call__(self) -> dict[str, Any]:
        """obstore's credential provider: the current parts, asked again after ``refresh`` (chain only)."""
        key_id, secret, token = self.current()
        expires = None if self._fixed is not None else datetime.now(timezone.utc) + self._refresh
        return {"access_key_id": key_id, "secret_access_key": secret, "token": token, "expires_at": expires}

    def scrub(self, text: str) -> str:
        """``text`` with every credential part this object handed out replaced by ``***``."""
        with self._lock:
            parts = sorted(self._seen, key=len, reverse=True)
        for part in parts:
            text = text.replace(part, "***")
        return text


class Settings:
    """What an ``s3://`` backend connects with: endpoint (``None``: AWS), region, credentials (``None``: anonymous)."""

    def __init__(self, endpoint: str | None, region: str, credentials: Credentials | None, profile: str | None,
                 session: Any = None) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.region = region
        self.credentials = credentials
        self.profile = profile
        #: The botocore session of the chain (``None`` for URL credentials or anonymous): its multipart client.
        self.session = session

    def __repr__(self) -> str:
        return (f"Settings(endpoint={self.endpoint!r}, region={self.region!r}, credentials={self.credentials!r}, "
                f"profile={self.profile!r})")  # fmt: skip

    def anonymous(self) -> Settings:
        return Settings(self.endpoint, self.region, None, self.profile)


def _profile_sections(profile: str, env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The profile's section of the shared credentials file and of the config file (empty when absent)."""
    home = Path(env.get("HOME") or Path.home())
    creds_file = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials").expanduser()
    config_file = Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config").expanduser()
    out = []
    config_section = profile if profile == "default" else f"profile {profile}"
    for path, section in ((creds_file, profile), (config_file, config_section)):
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except configparser.Error as exc:  # a malformed file is the user's to fix: say which
            raise ValueError(f"cannot read AWS file {path}: {type(exc).__name__} at line "
                             f"{getattr(exc, 'lineno', '?')}") from None  # fmt: skip
        out.append(dict(parser.items(section)) if parser.has_section(section) else {})
    return out[0], out[1]


def resolve(options: Mapping[str, Any], *, anonymous: bool = False, refresh_s: float = 60.0) -> Settings:
    """The endpoint, region and credentials of an ``s3://`` URL's options, the environment and the profile.

    :raises ValueError: a half-given pair in the URL, a named profile that does not exist, a malformed
        AWS file, or (unless ``anonymous``) no credentials anywhere in the chain.
    """
    env = os.environ
    explicit_profile = options.get("profile")
    profile = str(explicit_profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default")
    in_creds, in_config = _profile_sections(profile, env)
    if explicit_profile and not (in_creds or in_config):
        raise ValueError(f"AWS profile {profile!r} is not in the shared credentials or config file")
    region = str(options.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
                 or in_config.get("region") or "us-east-1")  # fmt: skip
    endpoint = (options.get("endpoint") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
                or in_config.get("endpoint_url") or None)  # fmt: skip
    if endpoint is not None:
        endpoint = str(endpoint).rstrip("/")
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"s3:// endpoint must be an http:// or https:// URL, got {endpoint!r}")
    named = profile if (in_creds or in_config) else None

    if options.get("key_id") or options.get("secret"):
        if not (options.get("key_id") and options.get("secret")):
            raise ValueError("s3:// needs both key_id= and secret= in the URL (or neither)")
        fixed = (str(options["key_id"]), str(options["secret"]), str(options.get("token") or "") or None)
        return Settings(endpoint, region, Credentials("url", fixed=fixed), named)
    if options.get("token"):
        raise ValueError("s3:// token= (a session token) needs key_id= and secret= beside it")
    if env.get("AWS_ACCESS_KEY_ID") and not env.get("AWS_SECRET_ACCESS_KEY") and not explicit_profile:
        raise ValueError("AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not")
    if anonymous:
        return Settings(endpoint, region, None, named)
    return _from_chain(endpoint, region, named, str(explicit_profile) if explicit_profile else None, refresh_s)


def _from_chain(endpoint: str | None, region: str, named: str | None, explicit: str | None,
                refresh_s: float) -> Settings:  # fmt: skip
    try:
        import botocore.exceptions
        import botocore.session
    except ImportError as exc:
        raise ValueError("s3:// reads AWS's credential chain with botocore: pip install botocore==1.44.18 (or give "
                         "key_id= and secret=)") from exc  # fmt: skip
    session = botocore.session.Session(profile=explicit)
    try:
        chain = session.get_credentials()
    except botocore.exceptions.BotoCoreError as exc:  # e.g. a profile's role or process that failed
        raise ValueError(f"s3:// could not get credentials from the AWS chain: {type(exc).__name__}: "
                         f"{_first_line(exc)}") from None  # fmt: skip
    if chain is None:
        raise ValueError(
            "s3:// found no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), "
            "use a profile (AWS_PROFILE, ~/.aws/credentials, ~/.aws/config), a web identity token "
            "(AWS_WEB_IDENTITY_TOKEN_FILE with AWS_ROLE_ARN), a container or instance role, pass key_id= and "
            "secret=, or anonymous=1 for a public bucket"
        )
    method = _METHODS.get(getattr(chain, "method", ""), getattr(chain, "method", "") or "AWS chain")
    if method == "profile" and named:
        method = f"profile {named}"
    return Settings(endpoint, region, Credentials(method, chain=chain, refresh_s=refresh_s), named, session)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:300]
