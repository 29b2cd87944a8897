"""file:// over several directories: pages striped by key, a lost directory loses only its share, as misses."""

from __future__ import annotations

import shutil

import pytest
import torch

import hicache_core as hc
from hicache_core.storage import make_storage
from hicache_core.testing.cases import as_bytes, fill_random
from hicache_core.testing.storage_kit import slots_of

PAGE = 4
N = 24


def _pool(seed: int):
    dev = hc.MHADevicePool(PAGE * 4, PAGE, torch.bfloat16, 8, 128, 2, "cpu")
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="reference", operations=[], size=PAGE * (N + 2))
    fill_random(list(host.plan.host_buffers.values()), torch.Generator().manual_seed(seed))
    return host


def _page(host, page: int) -> torch.Tensor:
    return as_bytes(host.get_data_page(page * PAGE, flat=True)).clone()


def _url(a, b, c) -> str:
    return f"file://{a}?dirs={b},{c}"


def test_pages_stripe_over_directories_and_a_lost_one_loses_only_its_share(tmp_path):
    dirs = [tmp_path / name for name in ("a", "b", "c")]
    src, dst = _pool(1), _pool(2)
    keys = [f"{i:064x}" for i in range(1, N + 1)]
    writer = make_storage(_url(*dirs), src, model_id="striped")
    assert all(r.ok for r in writer.write_pages(keys, slots_of(list(range(1, N + 1)), PAGE)))
    backend = writer.backend
    home = {k: backend.root_of(writer.namespace.key(k)) for k in keys}
    share = {d: [k for k in keys if home[k] == d] for d in dirs}
    assert all(share[d] for d in dirs), {str(d): len(v) for d, v in share.items()}  # each directory holds some
    for d in dirs:  # each page is in its own directory only
        on_disk = {p.name[: -len(".page")] for p in d.glob("*/*/*.page")}
        assert on_disk == set(share[d])
    assert backend.backend_stats()["directories"] == [str(d) for d in dirs]

    lost = dirs[1]
    for child in lost.iterdir():  # the drive's contents are gone (replaced, reformatted)
        shutil.rmtree(child)
    # A fresh instance, the directories named in another order: the striping follows the paths, not the order.
    reader = make_storage(_url(dirs[2], dirs[0], dirs[1]), dst, model_id="striped")
    slots = list(range(1, N + 1))
    results = reader.read_pages(keys, slots_of(slots, PAGE))
    for key, r, page in zip(keys, results, slots):
        if home[key] == lost:
            assert r.status.value == "missing", (key, r)
        else:
            assert r.ok, (key, r)
            assert torch.equal(_page(dst, page), _page(src, page)), key  # byte-exact, from the surviving drives
    assert sum(not r.ok for r in results) == len(share[lost])
    assert reader.batch_exists(keys) == next(i for i, k in enumerate(keys) if home[k] == lost)

    # Written again, the lost share lands back in its directory; the tier is whole.
    assert all(r.ok for r in reader.write_pages(keys, slots_of(slots, PAGE)))
    assert {p.name[: -len(".page")] for p in lost.glob("*/*/*.page")} == set(share[lost])
    assert reader.batch_exists(keys) == N


def test_a_removed_directory_reads_as_missing_and_is_made_again_on_write(tmp_path):
    dirs = [tmp_path / name for name in ("a", "b", "c")]
    src, dst = _pool(3), _pool(4)
    keys = [f"{i:064x}" for i in range(1, 9)]
    store = make_storage(_url(*dirs), src, model_id="gone")
    assert all(r.ok for r in store.write_pages(keys, slots_of(list(range(1, 9)), PAGE)))
    shutil.rmtree(dirs[0])
    home = [store.backend.root_of(store.namespace.key(k)) for k in keys]
    reader = make_storage(_url(*dirs), dst, model_id="gone")
    results = reader.read_pages(keys, slots_of(list(range(1, 9)), PAGE))
    assert [r.status.value for r in results] == ["missing" if h == dirs[0] else "ok" for h in home]
    assert all(r.ok for r in store.write_pages(keys, slots_of(list(range(1, 9)), PAGE)))
    assert all(r.ok for r in reader.read_pages(keys, slots_of(list(range(1, 9)), PAGE)))
    assert all(torch.equal(_page(src, p), _page(dst, p)) for p in range(1, 9))


def test_capacity_and_clear_span_every_directory(tmp_path):
    dirs = [tmp_path / name for name in ("a", "b", "c")]
    src = _pool(5)
    keys = [f"{i:064x}" for i in range(1, 13)]
    probe = make_storage(f"file://{tmp_path}/probe", src, model_id="cap")
    assert probe.write_pages(keys[:1], slots_of([1], PAGE))[0].ok
    page = probe.get_stats().backend["used_bytes"]
    store = make_storage(_url(*dirs) + f"&capacity={6 * page}", src, model_id="cap")
    assert all(r.ok for r in store.write_pages(keys, slots_of(list(range(1, 13)), PAGE)))
    stats = store.get_stats().backend
    assert stats["evicted"] == 6 and stats["used_bytes"] == 6 * page and stats["objects"] == 6
    assert store.backend.exists_objects(store.namespace.keys(keys)) == [False] * 6 + [True] * 6
    store.clear()
    assert not [p for d in dirs for p in d.glob("*/*/*.page")]


def test_directories_must_differ(tmp_path):
    with pytest.raises(ValueError, match="directories must differ"):
        make_storage(f"file://{tmp_path}/a?dirs={tmp_path}/b,{tmp_path}/a", _pool(6), model_id="dup")
