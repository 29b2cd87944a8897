"""``inspect=1``: a file:// store opened to be looked at (``hicache storage check``, ``stats``, ``explain-miss``)
creates nothing, tidies nothing, and a page it removes takes the folders it emptied with it."""

from __future__ import annotations

import os

import pytest
import torch

import hicache_core as hc
from hicache_core.storage import make_storage
from hicache_core.storage.backend import StorageError
from hicache_core.testing.cases import fill_random
from hicache_core.testing.storage_kit import slots_of

PAGE = 4


def _pool():
    dev = hc.MHADevicePool(PAGE * 4, PAGE, torch.bfloat16, 2, 64, 2, "cpu")
    host = hc.make_host_pool(dev, layout="page_first", io_backend="reference", operations=[], size=PAGE * 8)
    fill_random(list(host.plan.host_buffers.values()), torch.Generator().manual_seed(3))
    return host


def _tree(root) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size if p.is_file() else -1 for p in sorted(root.rglob("*"))}


def test_a_missing_directory_is_refused_not_created(tmp_path):
    for url in (f"file://{tmp_path / 'absent'}?inspect=1", f"file://{tmp_path}?inspect=1&dirs={tmp_path / 'b'}"):
        with pytest.raises(StorageError, match="does not exist \\(opened to inspect: nothing is created\\)"):
            make_storage(url)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="is not a directory"):
        make_storage(f"file://{tmp_path / 'file'}?inspect=1")


def test_opening_to_inspect_changes_nothing_and_a_removal_takes_its_folders(tmp_path):
    store = make_storage(f"file://{tmp_path}", _pool(), model_id="served", cluster_key=None)
    keys = [f"{i:064x}" for i in range(1, 4)]
    assert all(r.ok for r in store.write_pages(keys, slots_of([1, 2, 3], PAGE)))
    store.close()
    dead = tmp_path / store.namespace.prefix / "00" / f".x.page.{2**22 + 1}.0.0.tmp"  # a dead writer's
    dead.parent.mkdir(exist_ok=True)
    dead.write_bytes(b"half a page")
    before = _tree(tmp_path)

    looker = make_storage(f"file://{tmp_path}?inspect=1")
    stats = looker.get_stats().as_dict()["backend"]
    looker.close()
    assert _tree(tmp_path) == before and dead.exists()  # nothing tidied, nothing probed into the directory
    assert stats["objects"] == 3 and stats["stale_tmp_removed"] == 0
    assert stats["direct_directories"] in ({str(tmp_path): "not probed (inspect=1)"}, {})

    checker = make_storage(f"file://{tmp_path}?inspect=1", _pool(), model_id="check-1", cluster_key=None)
    checker.backend.check_steps()  # probes O_DIRECT, and leaves no probe file
    mine = [f"{i:064x}" for i in range(7, 10)]
    assert all(r.ok for r in checker.write_pages(mine, slots_of([4, 5, 6], PAGE)))
    assert _tree(tmp_path) != before
    checker.backend.remove_objects(checker.namespace.keys(mine))
    checker.close()
    assert _tree(tmp_path) == before  # its pages and the folders they made are gone; the served pages stay
    make_storage(f"file://{tmp_path}").close()
    assert not dead.exists()  # what inspect=1 left alone, a store opened to serve tidies


def test_without_inspect_the_directory_is_made_and_kept(tmp_path):
    root = tmp_path / "new"
    store = make_storage(f"file://{root}", _pool(), model_id="m", cluster_key=None)
    keys = [f"{i:064x}" for i in range(1, 3)]
    assert all(r.ok for r in store.write_pages(keys, slots_of([1, 2], PAGE)))
    store.backend.remove_objects(store.namespace.keys(keys))
    store.close()
    assert root.is_dir() and (root / store.namespace.prefix).is_dir()  # a server's folders stay (no race)
    assert os.access(root, os.W_OK)
