"""Loads that check what they move (hicache_core.gpu.checked_load): the copy and the page checksum in one launch.

On CPU pools under TRITON_INTERPRET=1 (the kernel on host copies), as CI runs them; on a GPU for real (scripts/dev gpu).
The oracle of the bytes is the device pool as the server filled it (SGLang's shapes), not the layout declaration.
"""

from __future__ import annotations

import os

import pytest
import torch
from core_helpers import DEVICE, device_pool, fill_random

import hicache_core as hc
from hicache_core.plugins.registry import get_registry
from hicache_core.pool.drops import DroppedIndicesError
from hicache_core.storage import PageStatus, make_storage
from hicache_core.verification.page_checksum import NO_CHECKSUM
from hicache_core.verification.verify import PageVerificationError

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on CPU pools: TRITON_INTERPRET=1"
)
pytest.importorskip("triton")

LAYERS = 3


def _cases() -> list[tuple[str, str]]:
    # Every pool kind in page_first, and the layouts whose host addressing differs (heads apart, layers first).
    kinds = sorted(get_registry().pool_kinds)
    more = [("mha", "layer_first"), ("mha", "page_head"), ("mha_asym", "page_first_direct"), ("mla", "layer_first")]
    return [(k, "page_first") for k in kinds if k not in ("vllm_page",)] + more


def _pool(kind: str, layout: str, page_size: int = 4, in_copy: bool = True):
    dp = device_pool(kind, page_size, pages=6, layers=LAYERS)
    comps = hc.pool.host_pool.pool_kind_of(dp).components
    fill_random([t for c in comps for t in getattr(dp, c.device_attr)], seed=5)
    host = hc.make_host_pool(dp, layout=layout, io_backend="kernel", verify=True)
    # CPU pools check in torch by default (the kernel runs them under the interpreter); HICACHE_VERIFY_IN_COPY
    # is off by default
    host.verifier = host.verification.make_verifier(kernel=DEVICE == "cpu" or None, in_copy=in_copy)
    return dp, host, comps


def _rows(host, dev: torch.Tensor) -> torch.Tensor:
    """The device rows a call's token slots name (page-item pools: one row a page)."""
    p = host.page_size
    return dev[::p] // p if host._items_are_pages else dev


def _device_image(dp, comps) -> dict[str, list[torch.Tensor]]:
    return {c.device_attr: [t.clone() for t in getattr(dp, c.device_attr)] for c in comps}


def _flip_host_byte(host, page: int, layer: int, part: int = 0) -> None:
    view = host.plan.parts[part].host_layer_view(layer)[page]
    view[0, 0, 5] ^= 0x40


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _load_checked(dp, host, h: torch.Tensor, d: torch.Tensor) -> None:
    """Load every layer of these items, then raise what the pool's checks found."""
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, h, d, layer, "kernel")
    host.check_verified()


@pytest.mark.parametrize("kind,layout", _cases())
def test_a_load_checked_in_the_copy_moves_the_bytes_and_catches_a_flipped_one(kind, layout):
    dp, host, comps = _pool(kind, layout)
    impl = host.implementation_for("load_to_device_per_layer")
    assert host.verification.in_copy == {impl.name: []}, host.verification.in_copy
    assert impl.load_check is not None and impl.load_to_device_per_layer == impl.load_check.load
    _moves_and_catches(dp, host, comps)


@pytest.mark.parametrize("kind", ["mha", "mla", "kv_scale_pages", "page_rows"])
@pytest.mark.parametrize("tiling", ["steps", "units", "row sums"])
def test_units_of_several_steps_or_several_pages_move_and_check_alike(kind, tiling):
    # The default tiles of these small pools are one step a unit; a tile of 4 words makes every row several
    # steps (the word loop), a tile of 64 items one unit of every page of the call where a page is one row;
    # row sums fold each step into one sum a row.
    dp, host, comps = _pool(kind, "page_first")
    check = host.implementation_for("load_to_device_per_layer").load_check
    check.tune(tile_items=64, tile_words=2048 if tiling == "units" else 4, row_sums=tiling == "row sums")
    assert check._one_step == (tiling == "units")
    if tiling == "units" and host._items_are_pages:
        assert check._pages_per_unit >= 3  # the call's three pages in one unit
    _moves_and_catches(dp, host, comps)


def _moves_and_catches(dp, host, comps) -> None:
    """Three pages back up and load byte for byte through the checked copy; then a flipped host byte names its
    page, its layer and its layer's own call."""
    p = host.page_size
    slots = host.alloc(3 * p)
    dev = torch.arange(p, 4 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "kernel")
    kept = _device_image(dp, comps)
    rows = _rows(host, dev)
    for c in comps:
        for t in getattr(dp, c.device_attr):
            t[rows.to(t.device)] = 0
    _load_checked(dp, host, slots, dev)  # nothing to report: every page is as it was backed up
    for c in comps:  # byte for byte what the server's device pool held
        for got, want in zip(getattr(dp, c.device_attr), kept[c.device_attr]):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), c.name
    bad = int(slots[p]) // p  # the second page of the call, in layer 1 of the last part
    _flip_host_byte(host, bad, layer=1, part=len(host.plan.parts) - 1)
    seqs = []
    with pytest.raises(PageVerificationError) as info:
        for layer in range(LAYERS):
            host.load_to_device_per_layer(dp, slots, dev, layer, "kernel")
            seqs.append(host._drops.seq)
        host.check_verified()
    err = info.value
    assert err.pages == [bad] and err.layer_ids == [1]
    assert err.calls == [(seqs[1], "load_to_device_per_layer", 1)]  # the layer's own call, not a batch's number
    assert f"host pages [{bad}]" in str(err) and "layer_id 1" in str(err)
    assert host.quarantined_pages() == {bad}
    assert sorted(set((host.take_failed_pages() // p).tolist())) == [bad]


def test_a_page_with_no_checksum_takes_the_loaded_one_then_is_checked_against_it():
    dp, host, comps = _pool("mha", "page_first")
    p = host.page_size
    slots = host.alloc(p)
    dev = torch.arange(p, 2 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "kernel")
    page = int(slots[0]) // p
    host.verifier.forget([page])  # its bytes were handed out: no checksum to check against
    assert bool((host.verifier.table[page] == NO_CHECKSUM).all())
    _load_checked(dp, host, slots, dev)
    _sync()
    assert not bool((host.verifier.table[page] == NO_CHECKSUM).any())  # taken by the loads
    _flip_host_byte(host, page, layer=2)
    with pytest.raises(PageVerificationError) as info:
        _load_checked(dp, host, slots, dev)
    assert info.value.pages == [page] and info.value.layer_ids == [2]


@pytest.mark.parametrize("dtypes", [(torch.int32, torch.int32), (torch.int32, torch.int64), (torch.int64, torch.int32)])
def test_int32_and_strided_indices_load_and_check_as_int64_ones(dtypes):
    dp, host, comps = _pool("mha", "layer_first")
    p = host.page_size
    slots = host.alloc(2 * p)
    dev = torch.arange(p, 3 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "kernel")
    kept = _device_image(dp, comps)
    for c in comps:
        for t in getattr(dp, c.device_attr):
            t[dev.to(t.device)] = 0
    # every other entry of a tensor twice as long: a strided view
    h = torch.stack([slots, slots]).t().reshape(-1).to(dtypes[0])[::2]
    d = torch.stack([dev, dev]).t().reshape(-1).to(dtypes[1])[::2]
    assert h.stride() == d.stride() == (2,)
    _load_checked(dp, host, h, d)
    for c in comps:
        for got, want in zip(getattr(dp, c.device_attr), kept[c.device_attr]):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_an_index_out_of_range_is_dropped_and_reported_not_written():
    dp, host, comps = _pool("mha", "page_first")
    p = host.page_size
    slots = host.alloc(p)
    dev = torch.arange(p, 2 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "kernel")
    rows = dp.k_buffer[0].shape[0]
    wild = dev.clone()
    wild[1] = rows + 7  # past the device pool
    before = _device_image(dp, comps)
    host.load_to_device_per_layer(dp, slots, wild, 0, "kernel")
    with pytest.raises(DroppedIndicesError):
        host.load_to_device_per_layer(dp, slots, dev, 1, "kernel")
    for c in comps:  # the other rows moved (they held the same bytes); nothing beyond the pool was touched
        assert torch.equal(getattr(dp, c.device_attr)[0].view(torch.uint8), before[c.device_attr][0].view(torch.uint8))


def test_a_plan_the_copy_cannot_check_says_why_and_its_loads_are_checked_apart():
    dp, host, comps = _pool("mla", "page_first_kv_split")
    impl = host.implementation_for("load_to_device_per_layer")
    assert host.verification.in_copy == {impl.name: ["component 'kv' is split over 2 host parts"]}
    assert impl.load_check is None
    p = host.page_size
    slots = host.alloc(p)
    dev = torch.arange(p, 2 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "kernel")
    _flip_host_byte(host, int(slots[0]) // p, layer=0, part=1)
    with pytest.raises(PageVerificationError) as info:
        _load_checked(dp, host, slots, dev)
    assert info.value.layer_ids == [0]


def test_verification_turned_off_gives_the_load_its_plain_copy_back():
    dp, host, comps = _pool("mha", "page_first")
    impl = host.implementation_for("load_to_device_per_layer")
    assert impl.load_check is not None
    host.verifier = None
    assert impl.load_check is None and "load_to_device_per_layer" not in vars(impl)
    again = host.verification.make_verifier(kernel=True, in_copy=False) if DEVICE == "cpu" else None
    if again is not None:
        host.verifier = again  # asked to check apart: the copy stays plain
        assert impl.load_check is None and host.verification.in_copy == {}


def test_a_layer_wise_load_checked_in_the_copy_names_the_failing_layers_call():
    dp, host, comps = _pool("mha", "page_first")
    p = host.page_size
    slots = host.alloc(2 * p)
    dev = torch.arange(p, 3 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "kernel")
    page = int(slots[p]) // p
    _flip_host_byte(host, page, layer=1, part=1)
    seq = host._drops.seq
    load = host.submit_load(dp, slots, dev, "kernel")
    try:
        load.result()
        host.check_verified()
    except hc.loads.layer_loads.LayerLoadError as exc:  # layer 2's call found layer 1's report first
        err = exc.__cause__
    except PageVerificationError as exc:
        err = exc
    else:
        pytest.fail("the flipped byte was not caught")
    assert isinstance(err, PageVerificationError)
    assert err.pages == [page] and err.layer_ids == [1]
    assert [c[0] - seq for c in err.calls] == [2]  # layer 1 was the load's second call


def test_a_page_that_failed_in_the_copy_is_never_written_to_l3_and_the_good_ones_are():
    # Checked in the copy, a flipped page fails during its own layer's copy and the load's next call raises
    # (apart, the load runs to its end and the next load raises). Either way the page is quarantined: an L3
    # write refuses it and writes the others, whose checksum rows travel with them.
    dp, host, comps = _pool("mha", "page_first")
    assert host.implementation_for("load_to_device_per_layer").load_check is not None
    p = host.page_size
    slots, dev = host.alloc(3 * p), torch.arange(p, 4 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "kernel")
    store = make_storage(f"memory://in-copy-{os.getpid()}", host, model_id="m")
    store.clear()
    bad = int(slots[2 * p]) // p
    _flip_host_byte(host, bad, layer=0)
    with pytest.raises(PageVerificationError) as info:
        _load_checked(dp, host, slots, dev)
    assert info.value.pages == [bad] and info.value.layer_ids == [0]
    keys = ["k0", "k1", "k2"]
    results = store.write_pages(keys, slots)
    assert [r.status for r in results] == [PageStatus.OK, PageStatus.OK, PageStatus.CORRUPT]
    assert "failed host-tier verification" in results[2].detail
    assert store.backend.exists_objects(store.namespace.keys(keys)) == [True, True, False]
    back = host.alloc(2 * p)
    rows = host.verifier.table[slots[: 2 * p : p] // p].clone()
    assert all(r.ok for r in store.read_pages(keys[:2], back))
    assert torch.equal(host.verifier.table[back[::p] // p], rows)  # the checksums came back with the pages
    _load_checked(dp, host, back, dev[: 2 * p])  # and the copy checks the prefetched pages against them
