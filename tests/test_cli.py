"""The hicache command."""

from __future__ import annotations

import json

import hicache_core as hc
from hicache_core.cli import main


def test_plugins_json(capsys):
    assert main(["plugins", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    direct = records["direct"]
    assert direct["distribution"] == "hicache-direct" and direct["status"] == "loaded"
    impl = direct["implementations"][0]
    assert impl["name"] == "direct.copy_engine" and impl["io_backend"] == "direct" and impl["priority"] == 10
    assert "page_first" in records["hicache_core"]["layouts"]


def test_plugins_text(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "direct (hicache-direct" in out and "implementation direct.copy_engine: io backend 'direct'" in out


def test_matrix(capsys):
    assert main(["matrix", "--pool", "mla", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    header = next(line for line in lines if line[:2] == ["pool", "layout"])
    direct = header.index("direct")
    kv_split = next(line for line in lines if line[:2] == ["mla", "page_first_kv_split"])
    assert kv_split[direct] == "direct.copy_engine"
    page_first = next(line for line in lines if line[:2] == ["mla", "page_first"])
    assert page_first[direct] == "-"


def test_matrix_json(capsys):
    assert main(["matrix", "--json", "--device", "cpu", "--sharded"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert (
        {r["pool"] for r in rows}
        == set(hc.get_registry().pool_kinds)
        >= {"mha", "mha_asym", "mha_k_only", "mla", "page_rows", "dsv4_paged", "dsv4_state"}
    )
    row = next(r for r in rows if (r["pool"], r["layout"], r["operation"]) ==
               ("mha", "layer_first", "backup_from_device_per_layer"))  # fmt: skip
    assert row["io_backends"]["direct"] == "direct.copy_engine"


def test_explain_text(capsys):
    code = main(["explain", "--pool", "mha", "--layout", "page_head", "--op", "load_to_device_per_layer",
                 "--io-backend", "direct"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "splits each item across heads" in out


def test_explain_unknown_layout(capsys):
    """A name nothing registers is bad usage (exit 2, one line on stderr); a combination no implementation serves is
    an answer (exit 1, the reasons on stdout, --json's {"resolved": false})."""
    code = main(["explain", "--pool", "mha", "--layout", "nope", "--op", "load_to_device_per_layer",
                 "--io-backend", "direct", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith("hicache explain: error: argument --layout: unknown layout 'nope'; layouts: "), err


def test_hicache_storage_check_runs_without_pytest(tmp_path):
    """hicache-core does not depend on pytest, so the command must not import the pytest kit."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pytest'] = None\n"  # any import of pytest now raises ImportError
        "from hicache_core.cli import main\n"
        f"sys.exit(main(['storage', 'check', 'file://{tmp_path}']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # The store's path (under pytest's tmp folder) shows in the warning that it has no cluster key.
    assert "pytest" not in done.stderr.replace(str(tmp_path), "")


def _tree(root) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size if p.is_file() else -1 for p in sorted(root.rglob("*"))}


def test_storage_check_and_stats_change_nothing_they_look_at(tmp_path, capsys):
    """A folder that does not exist is said so (exit 1), not made; one that does is left as it was found: the
    check's pages go with the folders they made, and nothing of the store's own is tidied."""
    missing = tmp_path / "absent"
    for command in ("check", "stats"):
        assert main(["storage", command, f"file://{missing}"]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err == (f"hicache storage {command}: cannot open file://{missing}: the storage directory "
                                     f"{missing} does not exist (opened to inspect: nothing is created)\n")  # fmt: skip
    assert not missing.exists()

    store = tmp_path / "l3"
    (store / "served-ns" / "ab").mkdir(parents=True)
    (store / "served-ns" / "ab" / "ab12.page").write_bytes(b"a page")
    (store / "served-ns" / "ab" / f".x.page.{2**22 + 1}.0.0.tmp").write_bytes(b"a dead writer's")
    before = _tree(store)
    assert main(["storage", "check", f"file://{store}"]) == 0
    assert main(["storage", "stats", f"file://{store}"]) == 0
    assert json.loads(capsys.readouterr().out.split("all checks passed\n", 1)[1])["backend"]["objects"] == 1
    assert _tree(store) == before
