"""Where an ``s3://`` backend finds its endpoint, region and credentials, as AWS users expect.

Order (the AWS CLI's): the URL's options; then ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``; then a profile (``?profile=`` or ``AWS_PROFILE``, else ``default``) in
``AWS_SHARED_CREDENTIALS_FILE`` (``~/.aws/credentials``) and ``AWS_CONFIG_FILE`` (``~/.aws/config``).
A ``?profile=`` in the URL is an explicit choice: it wins over the environment's keys.
Region: ``?region=``, ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile's, else ``us-east-1``.
Endpoint: ``?endpoint=``, ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the profile's ``endpoint_url``,
else AWS itself.

The secret parts never leave this module in text: :class:`Credentials` prints only where they came
from, and :meth:`Credentials.scrub` removes them from any message before it is shown.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Credentials:
    """An access key, its secret and an optional session token; ``repr`` shows only ``source``."""

    key_id: str = field(repr=False)
    secret: str = field(repr=False)
    token: str | None = field(default=None, repr=False)
    source: str = ""

    def scrub(self, text: str) -> str:
        """``text`` with every credential part replaced by ``***`` (for messages and logs)."""
        for part in sorted((p for p in (self.secret, self.token, self.key_id) if p), key=len, reverse=True):
            text = text.replace(part, "***")
        return text

    def as_obstore(self) -> dict[str, Any]:
        return {"access_key_id": self.key_id, "secret_access_key": self.secret, "token": self.token,
                "expires_at": None}  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """What an ``s3://`` backend connects with: endpoint (``None``: AWS), region, credentials (``None``: anonymous)."""

    endpoint: str | None
    region: str
    credentials: Credentials | None
    profile: str | None


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


def resolve(options: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
    """The endpoint, region and credentials of an ``s3://`` URL's options, the environment and the profile."""
    env = os.environ if env is None else env
    explicit_profile = options.get("profile")
    profile = str(explicit_profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default")
    in_creds, in_config = _profile_sections(profile, env)
    if explicit_profile and not (in_creds or in_config):
        raise ValueError(f"AWS profile {profile!r} is not in the shared credentials or config file")

    credentials: Credentials | None = None
    if options.get("key_id") or options.get("secret"):
        if not (options.get("key_id") and options.get("secret")):
            raise ValueError("s3:// needs both key_id= and secret= in the URL (or neither)")
        credentials = Credentials(str(options["key_id"]), str(options["secret"]), options.get("token") or None, "url")
    elif options.get("token"):
        raise ValueError("s3:// token= (a session token) needs key_id= and secret= beside it")
    profile_creds = in_creds if in_creds.get("aws_access_key_id") else in_config
    if credentials is None and explicit_profile and profile_creds.get("aws_access_key_id"):
        credentials = _from_profile(profile_creds, profile)
    if credentials is None and env.get("AWS_ACCESS_KEY_ID"):
        if not env.get("AWS_SECRET_ACCESS_KEY"):
            raise ValueError("AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not")
        credentials = Credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                                  env.get("AWS_SESSION_TOKEN") or None, "environment")  # fmt: skip
    if credentials is None and profile_creds.get("aws_access_key_id"):
        credentials = _from_profile(profile_creds, profile)

    region = str(options.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
                 or in_config.get("region") or "us-east-1")  # fmt: skip
    endpoint = (options.get("endpoint") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
                or in_config.get("endpoint_url") or None)  # fmt: skip
    if endpoint is not None:
        endpoint = str(endpoint).rstrip("/")
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"s3:// endpoint must be an http:// or https:// URL, got {endpoint!r}")
    return Settings(endpoint, region, credentials, profile if (in_creds or in_config) else None)


def _from_profile(section: Mapping[str, str], profile: str) -> Credentials:
    if not section.get("aws_secret_access_key"):
        raise ValueError(f"AWS profile {profile!r} has aws_access_key_id but no aws_secret_access_key")
    return Credentials(section["aws_access_key_id"], section["aws_secret_access_key"],
                       section.get("aws_session_token") or None, f"profile {profile}")  # fmt: skip
