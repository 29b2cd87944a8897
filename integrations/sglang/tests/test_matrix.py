"""The README's table of SGLang host-pool families is the one the code computes (``hicache_sglang.matrix``)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_matrix_is_current(capsys):
    from hicache_sglang import matrix

    assert matrix.main(["--check", str(README)]) == 0, capsys.readouterr().err


def test_matrix_reflects_the_registry():
    """A cell is what hicache's registry resolves: the seeds' layouts are served, direct only where SGLang drives it."""
    from hicache_sglang import families, matrix

    by_name = {f.name: f for f in families.POOLS}
    split = by_name["KV, MLA, layer-split (--enable-dsa-cache-layer-split)"]
    assert "kernel" in matrix.served(split, "page_first_kv_split")  # seed 001
    assert "kernel" in matrix.served(by_name["DSA indexer, layer-split"], "page_first")  # seed 004
    assert "kernel" in matrix.served(by_name["DSA indexer, layer-split"], "page_first_kv_split")  # seed 001's stack
    assert matrix.served(by_name["KV, MHA"], "page_head") == ["kernel"]  # SGLang's controller: no direct there
    assert len(by_name) == len(families.POOLS)
