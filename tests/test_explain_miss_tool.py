"""``hicache explain-miss`` and ``StorageController.explain_miss`` on the ``file://`` backend: every reason.

The same scenario (hicache_core.testing.explain_kit) runs against a real redis-server and a
real mooncake_master in the storage plugins' tests.
"""

from __future__ import annotations

import json

import pytest

from hicache_core.cli import main
from hicache_core.storage.explain import Outcomes
from hicache_core.testing import explain_kit as kit


def _corrupt_file(backend, key, offset):
    from hicache_storage_file.backend import HEADER_BLOCK

    from hicache_core.storage.page_format import HEADER_SIZE

    offset += HEADER_BLOCK - HEADER_SIZE if offset >= HEADER_SIZE else 0  # on disk the header is padded
    with open(backend.path_of(key), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def scenario(tmp_path, monkeypatch):
    monkeypatch.delenv("HICACHE_METRICS_DIR", raising=False)
    (tmp_path / "store").mkdir()
    (tmp_path / "outcomes").mkdir()
    sc = kit.run_scenario(f"file://{tmp_path / 'store'}", _corrupt_file, tmp_path / "outcomes")
    yield sc
    sc.storage.close()


def test_every_reason_live_from_the_store_and_from_the_memory_files(scenario, tmp_path, capsys, monkeypatch):
    kit.check_live_api(scenario)
    for name in kit.PREFIXES:
        # the store alone
        code = main(kit.cli_args(scenario, name, "--json"))
        report = json.loads(capsys.readouterr().out)
        assert [p["reason"] for p in report["pages"]] == kit.FROM_STORE[name], name
        assert report["outcomes_read"] is False and report["rank"] == 0
        assert report["namespace"] == scenario.storage.namespace.prefix
        assert code == (0 if all(r in ("in_host", "in_store") for r in kit.FROM_STORE[name]) else 1)
        # with the controllers' memory, written beside the metrics snapshot
        main(kit.cli_args(scenario, name, "--json", "--outcomes", str(tmp_path / "outcomes")))
        report = json.loads(capsys.readouterr().out)
        assert [p["reason"] for p in report["pages"]] == scenario.remembered(name), name
        assert report["outcomes_read"] is True
    # the memory's default place is $HICACHE_METRICS_DIR; and the text form
    monkeypatch.setenv("HICACHE_METRICS_DIR", str(tmp_path / "outcomes"))
    assert main(kit.cli_args(scenario, "host_full")) == 1
    monkeypatch.delenv("HICACHE_METRICS_DIR")
    out = capsys.readouterr().out
    assert "0 of 2 leading pages would hit" in out and out.count("host_pool_full") == 2
    assert main(kit.cli_args(scenario, "mixed")) == 1
    out = capsys.readouterr().out
    assert "2 of 8 leading pages would hit" in out and "checksum" in out and "no outcome memory" in out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith("page")]
    assert [line[5].rstrip(":") for line in lines] == kit.FROM_STORE["mixed"]


def test_the_memory_of_another_rank_is_not_used(scenario, tmp_path, capsys):
    main(kit.cli_args(scenario, "host_full", "--json", "--rank", "1", "--tp-size", "2",
                      "--outcomes", str(tmp_path / "outcomes")))  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    # rank 1 of 2 has its own namespace share: nothing of rank 0's is there, nor in its memory
    assert report["outcomes_read"] is False and report["rank"] == 1


def test_outcome_files_round_trip_and_bad_ones_are_refused(scenario, tmp_path, capsys):
    memory, tags = Outcomes.read(scenario.outcome_files[0])
    assert tags == {"namespace": scenario.storage.namespace.prefix, "rank": 0, "broken": ""}
    assert set(memory.last_counts(list(memory._last))) >= {"host_pool_full"}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "hicache-outcomes-1", "outcomes": {"k": ["hit", "", 0]}}))
    with pytest.raises(ValueError, match="not \\[reason, detail, time\\]"):
        Outcomes.read(bad)
    assert main(kit.cli_args(scenario, "mixed", "--outcomes", str(bad))) == 2
    assert "not [reason, detail, time]" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--token-ids", "1,2.5,3"], "non-negative integers, got '2.5'"),
    (["--token-ids", "1,-2"], "non-negative integers, got -2"),
    (["--token-ids", " "], "no token ids"),
    (["--token-ids", "1,2", "--layout", "nope"], "unknown layout 'nope'"),
    (["--token-ids", "1,2", "--page-size", "0"], "argument --page-size: takes an integer from 1 to 2147483647"),
    (["--token-ids", "1,2", "--rank", "2", "--tp-size", "2"], "--rank 2 is not a rank of --tp-size 2"),
    (["--token-ids", ",".join(map(str, range(8))), "--page-size", "4", "--host-pages", "3"],
     "host_pages=3 is not in [0, 2]"),
    (["--token-ids", "1,2", "--outcomes", "/nonexistent/x"], "neither an outcomes file"),
])  # fmt: skip
def test_bad_input_is_refused_before_the_store_is_asked(tmp_path, capsys, flags, message):
    store = tmp_path / "store"
    store.mkdir()
    args = ["explain-miss", f"file://{store}", "--model-id", "m", "--shape", kit.SHAPE, "--layers", "2", *flags]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and err.count("\n") == 1, err  # one line, on stderr
    assert [p for p in store.rglob("*")] == []  # nothing written, no folder made


def test_tokens_from_a_file_and_json(scenario, tmp_path, capsys):
    toks = kit.PREFIXES["host_full"][0]
    listing = tmp_path / "tokens.txt"
    listing.write_text("\n".join(map(str, toks)))
    as_json = tmp_path / "tokens.json"
    as_json.write_text(json.dumps(toks))
    for f in (listing, as_json):
        args = ["explain-miss", scenario.url, "--model-id", scenario.model_id, *kit.CLI_GEOMETRY, "--tokens", str(f)]
        assert main(args + ["--json"]) == 0
        assert [p["reason"] for p in json.loads(capsys.readouterr().out)["pages"]] == ["in_store"] * 2
    as_json.write_text(json.dumps([1, True]))
    args = ["explain-miss", scenario.url, "--model-id", scenario.model_id, *kit.CLI_GEOMETRY, "--tokens", str(as_json)]
    assert main(args) == 2 and "got True" in capsys.readouterr().err


def test_help_says_where_the_remembered_reasons_come_from(capsys):
    assert main(["explain-miss", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "timed_out, ranks_disagreed, host_pool_full" in out and "StorageController.explain_miss" in out


def test_ranks_disagreed_from_the_ranks_memory_files(tmp_path, capsys):
    """Two ranks over gloo, rank 1 late past the bound: both remember ranks_disagreed; the command reads it per rank."""
    from hicache_core.testing.storage_procs import late_rank, prefix_tokens, run_ranks

    store, outcomes = tmp_path / "store", tmp_path / "outcomes"
    store.mkdir()
    outcomes.mkdir()
    url = f"file://{store}"
    ranks = run_ranks(late_rank, 2, tmp_path, timeout=90, mode="delay", op_timeout=2.0, delay=4.0, url=url,
                      outcomes=str(outcomes))  # fmt: skip
    assert all(r["reasons"][0] == "ranks_disagreed" for r in ranks), ranks
    toks = prefix_tokens(8, kit.PAGE, salt=3)
    for rank in (0, 1):
        base = ["explain-miss", url, "--model-id", "late", *kit.CLI_GEOMETRY, "--rank", str(rank), "--tp-size", "2",
                "--token-ids", ",".join(map(str, toks)), "--json"]  # fmt: skip
        assert main(base) == 0  # the store alone: every page is there and sound
        assert {p["reason"] for p in json.loads(capsys.readouterr().out)["pages"]} == {"in_store"}
        assert main(base + ["--outcomes", str(outcomes)]) == 1
        report = json.loads(capsys.readouterr().out)
        assert [p["reason"] for p in report["pages"]] == ["ranks_disagreed"] * 8, report
        assert report["rank"] == rank and "agreement" in report["broken"]
