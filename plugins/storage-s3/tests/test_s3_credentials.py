"""Where s3:// takes its endpoint, region and credentials from, and that no credential is ever printed."""

from __future__ import annotations

import logging
import time

import pytest
from hicache_storage_s3.credentials import resolve
from http_stubs import CredentialsEndpoint, InstanceMetadata, Relay
from seaweedfs_server import ACCESS_KEY, PLUS_KEY, PLUS_SECRET, SECRET_KEY

from hicache_core.storage import make_storage, page_hashes
from hicache_core.storage.pages import Span
from hicache_core.storage.url import StorageURL
from hicache_core.testing.storage_kit import StorageCase, make_pool, slots_of

CASE = StorageCase("mha", "page_first", "plain", 4)
PLANTED = "planted-SECRET-c0ffee-never-print"
TOKEN = "planted-TOKEN-f00d-never-print"
KEY_ID = "PLANTEDKEYIDNEVERPRINT"


_AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
             "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN",
             "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
             "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN")  # fmt: skip


@pytest.fixture
def aws_env(tmp_path, monkeypatch):
    """An environment with no AWS settings but empty files of its own, and no instance metadata lookup."""
    for name in _AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / ".aws" / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / ".aws" / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return monkeypatch


def test_url_options_then_environment_then_profile(tmp_path, aws_env):
    pytest.importorskip("botocore", reason="AWS's credential chain is read with botocore: pip install botocore")
    aws = tmp_path / ".aws"
    aws.mkdir()
    (aws / "credentials").write_text("[default]\naws_access_key_id = PROFKEY\naws_secret_access_key = profsecret\n"
                                     "[other]\naws_access_key_id = OTHERKEY\naws_secret_access_key = othersecret\n"
                                     "aws_session_token = othertoken\n")  # fmt: skip
    (aws / "config").write_text("[default]\nregion = eu-west-3\n[profile other]\nregion = ap-south-1\n"
                                "endpoint_url = http://127.0.0.1:9\n")  # fmt: skip
    s = resolve({})
    assert (s.credentials.current()[0], s.credentials.source, s.region, s.endpoint) == (
        "PROFKEY", "profile default", "eu-west-3", None)  # fmt: skip
    for name, value in dict(AWS_ACCESS_KEY_ID="ENVKEY", AWS_SECRET_ACCESS_KEY="envsecret", AWS_SESSION_TOKEN="envtoken",
                            AWS_REGION="us-west-2", AWS_ENDPOINT_URL="http://127.0.0.1:1",
                            AWS_ENDPOINT_URL_S3="http://127.0.0.1:2").items():  # fmt: skip
        aws_env.setenv(name, value)
    s = resolve({})
    assert (s.credentials.current(), s.credentials.source) == (("ENVKEY", "envsecret", "envtoken"), "environment")
    assert (s.region, s.endpoint) == ("us-west-2", "http://127.0.0.1:2")  # the S3-specific endpoint wins
    s = resolve({"profile": "other"})  # an explicit profile beats the environment's keys
    assert (s.credentials.current(), s.credentials.source) == (("OTHERKEY", "othersecret", "othertoken"),
                                                               "profile other")  # fmt: skip
    aws_env.setenv("AWS_PROFILE", "other")
    assert resolve({}).credentials.source == "environment"  # AWS_PROFILE alone does not beat the keys
    s = resolve({"key_id": "URLKEY", "secret": "urlsecret", "region": "r1", "endpoint": "https://s3.example/"})
    assert (s.credentials.current(), s.region, s.endpoint) == (("URLKEY", "urlsecret", None), "r1",
                                                               "https://s3.example")  # fmt: skip
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
                 "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):  # fmt: skip
        aws_env.delenv(name)
    s = resolve({})  # AWS_PROFILE=other: its keys, region and endpoint
    assert (s.credentials.current()[0], s.region, s.endpoint) == ("OTHERKEY", "ap-south-1", "http://127.0.0.1:9")


@pytest.mark.parametrize(
    ("options", "env", "words"),
    [
        ({"key_id": "K"}, {}, "both key_id= and secret="),
        ({"token": "t"}, {}, "needs key_id= and secret="),
        ({"profile": "nope"}, {}, "'nope' is not in"),
        ({}, {"AWS_ACCESS_KEY_ID": "K"}, "AWS_SECRET_ACCESS_KEY is not"),
        ({"endpoint": "127.0.0.1:9000"}, {}, "http:// or https://"),
        ({}, {}, "found no credentials"),
    ],
)
def test_incomplete_settings_are_refused(aws_env, options, env, words):
    pytest.importorskip("botocore", reason="AWS's credential chain is read with botocore: pip install botocore")
    for name, value in env.items():
        aws_env.setenv(name, value)
    with pytest.raises(ValueError, match=words):
        resolve(options)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("s3://b?timeout=0", "positive number of seconds"),
        ("s3://b?concurrency=0", "integer >= 1"),
        ("s3://b?part_size=1MiB", "at least 5MiB"),
        ("s3://b?colour=red", "does not take option"),
        ("s3://user:pw@b/p", "no user-info"),
        ("s3://b:9000/p", "names a bucket"),
        ("s3://b/a//c", "empty, '.' or '..'"),
        ("s3://b?ca=/x&endpoint=http://127.0.0.1:1", "needs an https:// endpoint"),
    ],
)
def test_bad_urls_are_refused_before_anything_opens(url, words, s3_env):
    with pytest.raises(ValueError, match=words):
        make_storage(url)


def test_no_credentials_anywhere_is_an_error_that_lists_the_chain(aws_env):
    pytest.importorskip("obstore", reason="the s3:// client is not installed: pip install obstore==0.12.1")
    with pytest.raises(ValueError, match="found no credentials.*AWS_ACCESS_KEY_ID.*web identity.*instance role"):
        make_storage("s3://b/p?endpoint=http://127.0.0.1:1")
    assert make_storage("s3://b/p?endpoint=http://127.0.0.1:1&anonymous=1").backend.settings.credentials is None


def test_a_planted_secret_never_appears(seaweedfs, s3_bucket, s3_env, monkeypatch, capsys, caplog, tmp_path):
    """Refused (wrong key id, secret, token) and accepted credentials: no message, repr, stat, log or metric has
    any part of them, the access key id included."""
    from hicache_core import metrics
    from hicache_core.cli import main

    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    host = make_pool(CASE, pages=16, seed=3)
    keys = page_hashes(list(range(16)), 4)
    wrong = seaweedfs.url(s3_bucket, "p", timeout=2, key_id=ACCESS_KEY, secret=PLANTED, token=TOKEN)
    unknown = seaweedfs.url(s3_bucket, "p", timeout=2, key_id=KEY_ID, secret=PLANTED)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PLANTED)  # and in the environment, for the env-only run
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    for url in (wrong, unknown, seaweedfs.url(s3_bucket, "p", timeout=2)):
        store = make_storage(url, host, model_id="m")
        backend = store.backend
        seen += [repr(store), repr(backend), str(backend.settings), repr(backend.settings.credentials),
                 repr(backend.url), backend.url.redacted, str(backend.backend_stats())]  # fmt: skip
        backend = store
        results = backend.write_pages(keys, slots_of([1, 2, 3, 4], 4))
        results += backend.read_pages(keys, slots_of([5, 6, 7, 8], 4))
        assert not any(r.ok for r in results)
        seen += [r.detail for r in results]
        for call in (backend.ping, lambda b=backend: b.batch_exists(keys)):
            with pytest.raises(Exception) as info:
                call()
            seen += [str(info.value), repr(info.value)]
        seen.append(str(backend.get_stats().as_dict()))
        backend.close()
        assert main(["storage", "check", url]) != 0
        assert main(["storage", "stats", url]) != 0
    # The accepted secret (the server's) must not be printed either.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.delenv("AWS_SESSION_TOKEN")
    good = make_storage(seaweedfs.url(s3_bucket, "p"), host, model_id="m")
    assert all(r.ok for r in good.write_pages(keys, slots_of([1, 2, 3, 4], 4)))
    seen += [repr(good), str(good.get_stats().as_dict()), repr(good.backend.settings)]
    good.clear()
    good.close()
    assert main(["storage", "check", seaweedfs.url(s3_bucket, "p")]) == 0
    assert main(["storage", "stats", seaweedfs.url(s3_bucket, "p")]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and '"credentials_from": "environment"' in out
    seen += [out, caplog.text, str(metrics.snapshot())]
    text = "\n".join(seen)
    assert "credentials were refused" in text  # the refusal is explained...
    for secret in (PLANTED, TOKEN, SECRET_KEY, KEY_ID, ACCESS_KEY):  # ...without a credential part in it
        assert secret not in text, f"a credential appears in:\n{text[max(0, text.find(secret) - 300) :][:600]}"


def test_url_options_keep_a_literal_plus_and_decode_percent_escapes():
    url = StorageURL.parse("s3://b/p?secret=a+b/c%2Bd%2Fe%20f&key_id=K%2BEY&region=r")
    assert url.query == {"secret": "a+b/c+d/e f", "key_id": "K+EY", "region": "r"}
    assert "K%2BEY" not in url.redacted and "key_id=***" in url.redacted and "secret=***" in url.redacted
    assert "K+EY" not in repr(url)


@pytest.mark.parametrize("written", ["literal", "percent-encoded"])
def test_a_secret_with_plus_and_slash_signs_requests(seaweedfs, s3_bucket, s3_env, written):
    from urllib.parse import quote

    secret = PLUS_SECRET if written == "literal" else quote(PLUS_SECRET, safe="")
    assert ("+" in secret) == (written == "literal")
    host = make_pool(CASE, pages=16, seed=4)
    store = make_storage(seaweedfs.url(s3_bucket, f"plus-{written}", key_id=PLUS_KEY, secret=secret, timeout=5),
                         host, model_id="m")  # fmt: skip
    keys = page_hashes(list(range(16)), 4)
    assert all(r.ok for r in store.write_pages(keys, slots_of([1, 2, 3, 4], 4)))
    assert all(r.ok for r in store.read_pages(keys, slots_of([5, 6, 7, 8], 4)))
    store.backend.clear()
    store.close()


def test_a_session_token_from_the_environment_is_sent_with_every_request(seaweedfs, s3_bucket, s3_env, monkeypatch):
    """AWS_SESSION_TOKEN rides on every request, obstore's and the multipart client's.

    SeaweedFS takes a request with a session token for one signed with temporary credentials it issued
    itself, and refuses it: the test asserts what the client sends, and that the refusal is explained
    without the token in it.
    """
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    relay = Relay(seaweedfs.port)
    try:
        url = f"s3://{s3_bucket}/token?endpoint={relay.endpoint}&part_size=5MiB&timeout=10&retries=0"
        backend = make_storage(url).backend
        assert backend.backend_stats()["credentials_from"] == "environment"
        small, big = bytearray(b"s" * 1000), bytearray(b"b" * (6 << 20))
        results = backend.put_objects(["small", "big"], [[Span(0, len(small), memoryview(small))],
                                                         [Span(0, len(big), memoryview(big))]])  # fmt: skip
        with pytest.raises(Exception, match="credentials were refused") as info:
            backend.exists_objects(["small"])
        backend.close()
    finally:
        relay.close()
    assert all("credentials were refused" in str(r) for r in results), results
    assert TOKEN not in " ".join(map(str, results)) + str(info.value)
    lines = [h.split("\r\n", 1)[0] for h in relay.heads]
    assert any(line.startswith("PUT") for line in lines) and any(line.startswith("HEAD") for line in lines)
    assert any(line.startswith("POST") and "uploads" in line for line in lines), "the multipart client sent nothing"
    for head in relay.heads:
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in head.split("\r\n")[1:])}
        assert headers.get("x-amz-security-token") == TOKEN, head.split("\r\n")[0]


def test_a_container_role_is_refreshed_and_its_tokens_sent(seaweedfs, s3_bucket, aws_env):
    """Temporary credentials from a container role (the ECS/EKS endpoint, served here on 127.0.0.1) are
    asked for again as they near their end: the requests carry each new session token in turn."""
    pytest.importorskip("botocore", reason="AWS's credential chain is read with botocore: pip install botocore")
    endpoint = CredentialsEndpoint(ACCESS_KEY, SECRET_KEY, valid_s=300)  # within botocore's refresh window
    relay = Relay(seaweedfs.port)
    aws_env.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", endpoint.url)
    try:
        backend = make_storage(f"s3://{s3_bucket}/role?endpoint={relay.endpoint}&refresh=0.3&retries=0").backend
        assert backend.backend_stats()["credentials_from"] == "container role"
        backend.put_objects(["a"], [[Span(0, 3, memoryview(bytearray(b"abc")))]])
        first = len(relay.heads)
        time.sleep(0.6)  # past obstore's refresh interval: it asks the chain again
        results = backend.put_objects(["b"], [[Span(0, 3, memoryview(bytearray(b"abc")))]])
        backend.close()
    finally:
        relay.close()
        endpoint.close()
    sent = [_header(h, "x-amz-security-token") for h in relay.heads]
    assert all(t in endpoint.issued for t in sent), (sent, endpoint.issued)
    assert sent[first] != sent[first - 1], "the second batch signed with the first batch's token"
    assert len(endpoint.issued) >= 2
    assert not any(t in str(results) for t in endpoint.issued)


@pytest.mark.parametrize("link", ["instance role", "web identity"])
def test_the_chain_reaches_instance_roles_and_web_identity(seaweedfs, s3_bucket, aws_env, tmp_path, link):
    """The chain's last links, each served on 127.0.0.1: an EC2 instance role (IMDSv2) and a web identity
    token exchanged with STS. Their session token signs the requests (SeaweedFS refuses tokens it did not
    issue: the test asserts what is sent)."""
    pytest.importorskip("botocore", reason="AWS's credential chain is read with botocore: pip install botocore")
    services = InstanceMetadata(ACCESS_KEY, SECRET_KEY)
    relay = Relay(seaweedfs.port)
    if link == "instance role":
        aws_env.delenv("AWS_EC2_METADATA_DISABLED")
        aws_env.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", services.endpoint)
    else:
        (tmp_path / "web-token").write_text("a-web-identity-jwt")
        aws_env.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "web-token"))
        aws_env.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/hicache")
        aws_env.setenv("AWS_ENDPOINT_URL_STS", services.endpoint)
    try:
        backend = make_storage(f"s3://{s3_bucket}/chain?endpoint={relay.endpoint}&retries=0").backend
        assert backend.backend_stats()["credentials_from"] == link
        (result,) = backend.put_objects(["a"], [[Span(0, 3, memoryview(bytearray(b"abc")))]])
        backend.close()
    finally:
        relay.close()
        services.close()
    assert services.issued and _header(relay.heads[0], "x-amz-security-token") == services.issued[-1]
    assert link == "instance role" or services.web_tokens == ["a-web-identity-jwt"]
    assert not any(t in str(result) for t in services.issued)


def _header(head: str, name: str) -> str | None:
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name:
            return value.strip()
    return None
