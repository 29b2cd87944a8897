"""Secret settings never show: ``hicache settings`` (table and ``--json``), refusals, and the other commands.

``HICACHE_L3_KEY`` is the cluster's key itself; ``hicache settings`` exists to be pasted into logs. A
setting declared ``secret=True`` is shown only as what its ``show`` makes of it (the key: its key id), a
value it refuses is named by its length, and ``python -m hicache_core.settings.registry`` does not print
it. Every output is scanned for the key and for every 8-character piece of it; what a failing assertion
prints has those pieces hidden, so that a leak is reported without being repeated.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_settings_declared import _declared_in_tree

from hicache_core import settings
from hicache_core.settings import registry as settings_registry
from hicache_core.storage.page_auth import ClusterKey

ROOT = Path(__file__).resolve().parents[1]
KEY = "e8e729bba26fe86eb805e5e91767acf4e900399538a053f39e8ddfcef1127147"  # planted; 64 hex characters
SHORT = KEY[:20]  # a key too short, refused
KEY_ID = ClusterKey(KEY.encode()).key_id.hex()
HICACHE = str(Path(sys.executable).with_name("hicache"))
#: A name that says its value is, or may carry, a secret (a URL may carry a password); a ``..._FILE`` is a path.
SECRET_NAME = re.compile(r"_(KEY|PASSWORD|PASSWD|PASS|SECRET|TOKEN|CREDENTIALS?|AUTH|URL)$")


def leaks(text: str, secret: str = KEY) -> int:
    """How many of the 8-character pieces of ``secret`` show in ``text`` (0: nothing of it leaks)."""
    return sum(secret[i : i + 8] in text for i in range(len(secret) - 7))


def hide(text: str, secret: str = KEY) -> str:
    """``text`` with every 8-character piece of ``secret`` replaced by ``***``: what an assertion may print."""
    for i in range(len(secret) - 7):
        text = text.replace(secret[i : i + 8], "***")
    return text


def run_cli(*argv: str, **env_extra: str) -> tuple[int, str, str, int]:
    """Run a command with only ``env_extra`` of the HICACHE_* variables: (exit code, stdout, stderr, pieces of
    the planted keys it showed), its outputs with those pieces hidden."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env.update(env_extra)
    done = subprocess.run(list(argv), capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    both = done.stdout + done.stderr
    return done.returncode, hide(done.stdout), hide(done.stderr), leaks(both) + leaks(both, SHORT)


def test_hicache_settings_shows_the_key_id_never_the_key():
    code, out, err, leaked = run_cli(HICACHE, "settings", HICACHE_L3_KEY=KEY)
    assert (code, leaked) == (0, 0), err
    line = next(line for line in out.splitlines() if line.startswith("HICACHE_L3_KEY "))
    assert re.split(r"\s{2,}", line)[1] == f"<secret: key id {KEY_ID}>", line

    code, out, err, leaked = run_cli(HICACHE, "settings", "--json", HICACHE_L3_KEY=KEY)
    assert (code, leaked) == (0, 0), err
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["HICACHE_L3_KEY"]["value"] == f"<secret: key id {KEY_ID}>"
    assert (rows["HICACHE_L3_KEY"]["source"], rows["HICACHE_L3_KEY"]["error"]) == ("environment", None)


def test_a_key_too_short_is_refused_by_its_length_only():
    code, out, err, leaked = run_cli(HICACHE, "settings", "--json", HICACHE_L3_KEY=SHORT)
    assert (code, leaked) == (1, 0), err
    assert "refused: the cluster key from HICACHE_L3_KEY is 20 bytes; it must be at least 32" in err
    row = next(row for row in json.loads(out) if row["name"] == "HICACHE_L3_KEY")
    assert row["value"] == "(refused)" and "20 bytes" in row["error"]


def test_a_shell_script_cannot_print_a_secret_setting():
    argv = (sys.executable, "-m", "hicache_core.settings.registry", "HICACHE_L3_KEY")
    assert run_cli(*argv, HICACHE_L3_KEY=KEY) == (
        2, "", "HICACHE_L3_KEY is secret: it is never printed (hicache settings shows what may be shown of it)\n", 0,
    )  # fmt: skip


def test_the_storage_commands_never_print_the_key(tmp_path):
    """``hicache storage check|stats`` read the key from the same variable: its id shows, the key does not.

    A guard: these printed no key before ``secret=True`` either (tests/test_storage_secrets.py scans them in
    process); here they run as the command a user pastes from.
    """
    (tmp_path / "l3").mkdir()  # the check inspects a store; it creates none
    url = f"file://{tmp_path / 'l3'}"
    # The text form; the --json form runs in tests/test_storage_unkeyed.py, and `storage stats` in process in
    # tests/test_storage_secrets.py (each command a process costs CI seconds of torch's import).
    code, out, err, leaked = run_cli(HICACHE, "storage", "check", url, HICACHE_L3_KEY=KEY)
    assert (code, leaked) == (0, 0), f"hicache storage check: {out}{err}"
    assert out.splitlines()[-2:] == [
        f"  ok   pages authenticated with the cluster key (key id {KEY_ID}, from HICACHE_L3_KEY)",
        "all checks passed",
    ], out
    assert "UNAUTHENTICATED" not in out + err and "WARN" not in out
    code, out, err, leaked = run_cli(HICACHE, "storage", "check", url, HICACHE_L3_KEY=SHORT)  # make_storage refuses
    assert (code, leaked) == (2, 0) and "is 20 bytes; it must be at least 32" in err, out + err


def test_a_secret_is_hidden_by_default_and_its_refusal_does_not_quote_it(monkeypatch):
    planted = "Pl4nted-token-0193"
    secret = settings.Setting("HICACHE_X_TOKEN", int, "an integer", secret=True, doc="a token")
    assert hide(secret.show(planted), planted) == "<secret, 18 characters>"
    with pytest.raises(settings.SettingError) as refused:
        secret.parse_text(planted)
    assert hide(str(refused.value), planted) == "HICACHE_X_TOKEN (secret, 18 characters) is not an integer"
    plain = settings.Setting("HICACHE_X_COUNT", int, "an integer")
    with pytest.raises(settings.SettingError, match="^HICACHE_X_COUNT='x1' is not an integer$"):
        plain.parse_text("x1")

    key = settings.text("HICACHE_X_KEY", doc="a key", secret=True)
    declared = {s.name: settings_registry.Declared(s, "test") for s in (secret, key)}
    monkeypatch.setattr(settings_registry, "declared", lambda: declared)
    rows = settings_registry.current({"HICACHE_X_TOKEN": planted, "HICACHE_X_KEY": planted})
    dumped = json.dumps([row.as_dict() for row in rows])
    assert leaks(dumped, planted) == 0, hide(dumped, planted)
    shown = {row.name: (row.value, row.error) for row in rows}
    refusal = "HICACHE_X_TOKEN (secret, 18 characters) is not an integer"
    assert shown == {"HICACHE_X_KEY": ("<secret, 18 characters>", None), "HICACHE_X_TOKEN": ("(refused)", refusal)}


def test_every_secret_bearing_setting_is_declared_secret():
    """By name, over the core's, every plugin's and every adapter's declarations (installed or not)."""
    declared = _declared_in_tree()
    named = {name for name in declared if SECRET_NAME.search(name)}
    assert {"HICACHE_L3_KEY", "HICACHE_SGLANG_STORAGE_URL"} <= named  # the scan sees the known ones
    undeclared = sorted(f"{name} ({declared[name][0]})" for name in named if not declared[name][1].secret)
    assert not undeclared, f"settings that may hold a secret but are not declared secret=True: {undeclared}"
    assert not declared["HICACHE_L3_KEY_FILE"][1].secret  # a path; the file's mode guards the key
    url = declared["HICACHE_SGLANG_STORAGE_URL"][1]
    password = "Pl4nted-pw-77"
    assert hide(url.show(f"redis://u:{password}@cache:6379/0"), password) == "redis://u:***@cache:6379/0"
    assert leaks(url.show(f"redis://u:{password}@cache:6379/0"), password) == 0
