"""Where s3:// takes its endpoint, region and credentials from, and that no credential is ever printed."""

from __future__ import annotations

import logging

import pytest
from hicache_storage_s3.credentials import resolve
from seaweedfs_server import ACCESS_KEY, SECRET_KEY

from hicache_core.storage import make_storage, page_hashes
from hicache_core.testing.storage_kit import StorageCase, make_pool, slots_of

CASE = StorageCase("mha", "page_first", "plain", 4)
PLANTED = "planted-SECRET-c0ffee-never-print"
TOKEN = "planted-TOKEN-f00d-never-print"


def _clean_env(tmp_path, **extra):
    return {"HOME": str(tmp_path), **extra}


def test_url_options_then_environment_then_profile(tmp_path):
    aws = tmp_path / ".aws"
    aws.mkdir()
    (aws / "credentials").write_text("[default]\naws_access_key_id = PROFKEY\naws_secret_access_key = profsecret\n"
                                     "[other]\naws_access_key_id = OTHERKEY\naws_secret_access_key = othersecret\n"
                                     "aws_session_token = othertoken\n")  # fmt: skip
    (aws / "config").write_text("[default]\nregion = eu-west-3\n[profile other]\nregion = ap-south-1\n"
                                "endpoint_url = http://127.0.0.1:9\n")  # fmt: skip
    env = _clean_env(tmp_path)
    s = resolve({}, env)
    assert (s.credentials.key_id, s.credentials.source, s.region, s.endpoint) == ("PROFKEY", "profile default",
                                                                                 "eu-west-3", None)  # fmt: skip
    env.update(AWS_ACCESS_KEY_ID="ENVKEY", AWS_SECRET_ACCESS_KEY="envsecret", AWS_SESSION_TOKEN="envtoken",
               AWS_REGION="us-west-2", AWS_ENDPOINT_URL="http://127.0.0.1:1", AWS_ENDPOINT_URL_S3="http://127.0.0.1:2")
    s = resolve({}, env)
    assert (s.credentials.key_id, s.credentials.token, s.credentials.source) == ("ENVKEY", "envtoken", "environment")
    assert (s.region, s.endpoint) == ("us-west-2", "http://127.0.0.1:2")  # the S3-specific endpoint wins
    s = resolve({"profile": "other"}, env)  # an explicit profile beats the environment's keys
    assert (s.credentials.key_id, s.credentials.token, s.credentials.source) == ("OTHERKEY", "othertoken",
                                                                                 "profile other")  # fmt: skip
    env["AWS_PROFILE"] = "other"
    assert resolve({}, env).credentials.source == "environment"  # AWS_PROFILE alone does not beat the keys
    s = resolve({"key_id": "URLKEY", "secret": "urlsecret", "region": "r1", "endpoint": "https://s3.example/"}, env)
    assert (s.credentials.key_id, s.credentials.token, s.region, s.endpoint) == ("URLKEY", None, "r1",
                                                                                 "https://s3.example")  # fmt: skip
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env["AWS_REGION"], env["AWS_ENDPOINT_URL_S3"]
    del env["AWS_ENDPOINT_URL"]
    s = resolve({}, env)  # AWS_PROFILE=other: its keys, region and endpoint
    assert (s.credentials.key_id, s.region, s.endpoint) == ("OTHERKEY", "ap-south-1", "http://127.0.0.1:9")


@pytest.mark.parametrize(
    ("options", "env", "words"),
    [
        ({"key_id": "K"}, {}, "both key_id= and secret="),
        ({"token": "t"}, {}, "needs key_id= and secret="),
        ({"profile": "nope"}, {}, "'nope' is not in"),
        ({}, {"AWS_ACCESS_KEY_ID": "K"}, "AWS_SECRET_ACCESS_KEY is not"),
        ({"endpoint": "127.0.0.1:9000"}, {}, "http:// or https://"),
    ],
)
def test_incomplete_settings_are_refused(tmp_path, options, env, words):
    with pytest.raises(ValueError, match=words):
        resolve(options, _clean_env(tmp_path, **env))


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


def test_no_credentials_is_an_error_not_a_metadata_lookup(tmp_path, monkeypatch):
    pytest.importorskip("obstore", reason="the s3:// client is not installed: pip install obstore==0.12.1")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ValueError, match="found no credentials.*AWS_ACCESS_KEY_ID"):
        make_storage("s3://b/p?endpoint=http://127.0.0.1:1")
    assert make_storage("s3://b/p?endpoint=http://127.0.0.1:1&anonymous=1").settings.credentials is None


def test_a_planted_secret_never_appears(seaweedfs, s3_bucket, s3_env, monkeypatch, capsys, caplog, tmp_path):
    """Refused (wrong secret, token) and accepted credentials: no message, repr, stat, log or metric has them."""
    from hicache_core import metrics
    from hicache_core.cli import main

    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    host = make_pool(CASE, pages=16, seed=3)
    keys = page_hashes(list(range(16)), 4)
    wrong = seaweedfs.url(s3_bucket, "p", timeout=2, key_id=ACCESS_KEY, secret=PLANTED, token=TOKEN)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PLANTED)  # and in the environment, for the env-only run
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    for url in (wrong, seaweedfs.url(s3_bucket, "p", timeout=2)):
        backend = make_storage(url, host, model_id="m")
        seen += [repr(backend), str(backend.settings), repr(backend.settings.credentials), repr(backend.url)]
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
    seen += [repr(good), str(good.get_stats().as_dict())]
    good.clear()
    good.close()
    assert main(["storage", "check", seaweedfs.url(s3_bucket, "p")]) == 0
    assert main(["storage", "stats", seaweedfs.url(s3_bucket, "p")]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and '"credentials_from": "environment"' in out
    seen += [out, caplog.text, str(metrics.snapshot())]
    text = "\n".join(seen)
    assert "credentials were refused" in text  # the refusal is explained...
    for secret in (PLANTED, TOKEN, SECRET_KEY):  # ...without a credential in it
        assert secret not in text, f"a credential appears in:\n{text[max(0, text.find(secret) - 300):][:600]}"
