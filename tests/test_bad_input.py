"""Bad input gets a clear error before any byte moves, and both pools stay as they were."""

from __future__ import annotations

import pytest
import torch
from core_helpers import DEVICE, device_pool, device_tensors, fill_random, host_tensors, random_page_slots, snapshot

import hicache_core as hc


@pytest.fixture(params=["direct", "reference"])
def pools(request, direct_only):
    dev = device_pool("mha", 4, pages=6, sharded=True)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend=request.param, size=24, registry=direct_only)
    fill_random(device_tensors(dev) + host_tensors(host), seed=7)
    before = snapshot(device_tensors(dev) + host_tensors(host))
    yield dev, host, request.param
    after = snapshot(device_tensors(dev) + host_tensors(host))
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a rejected call changed a pool"


H = random_page_slots(4, 2, 4, seed=1)
D = random_page_slots(6, 2, 4, seed=2, first=1)


def test_length_mismatch(pools):
    dev, host, io = pools
    with pytest.raises(ValueError, match=r"1-D and of equal length, got \(8,\) and \(7,\)"):
        host.load_to_device_per_layer(dev, H, D[:7], 1, io)


def test_wrong_dtype(pools):
    dev, host, io = pools
    with pytest.raises(TypeError, match="indices must be int32 or int64, got host torch.float32"):
        host.backup_from_device_all_layer(dev, H.float(), D, io)


def test_not_a_tensor(pools):
    dev, host, io = pools
    with pytest.raises(TypeError, match="host_indices must be a torch tensor of int32/int64 slots, got list"):
        host.backup_from_device_per_layer(dev, H.tolist(), D, 1, io)


@pytest.mark.parametrize("layer_id", [3, -1, 100])
def test_layer_out_of_range(pools, layer_id):
    dev, host, io = pools
    with pytest.raises(IndexError, match=rf"layer_id {layer_id} is out of range \[0, 3\)"):
        host.load_to_device_per_layer(dev, H, D, layer_id, io)


def test_layer_not_owned_is_a_no_op(pools):
    dev, host, io = pools
    host.load_to_device_per_layer(dev, H, D, 0, io)  # layer 0 belongs to another rank


def test_draft_layer_without_draft_pool(pools):
    dev, host, io = pools
    with pytest.raises(IndexError, match="draft layer_id 3 is out of range"):
        host.load_to_device_per_layer(dev, H, D, 3, io, is_draft=True)


def test_wrong_device_pool(pools):
    dev, host, io = pools
    with pytest.raises(ValueError, match=r"is not the device pool the host pool \d+ \(mha, layout \w+\) was made for"):
        host.load_to_device_per_layer(device_pool("mha", 4, pages=6, sharded=True), H, D, 1, io)


def test_io_backend_not_resolved(pools):
    dev, host, io = pools
    with pytest.raises(ValueError, match="io_backend 'kernel' was not resolved for this host pool"):
        host.load_to_device_per_layer(dev, H, D, 1, "kernel")
    with pytest.raises(ValueError, match="io_backend None was not resolved"):
        host.backup_from_device_all_layer(dev, H, D, None)


def test_out_of_range_indices_direct(direct_only):
    dev = device_pool("mla", 4, pages=6)
    host = hc.make_host_pool(dev, layout="page_first_direct", io_backend="direct", size=24, registry=direct_only)
    fill_random(device_tensors(dev) + host_tensors(host), seed=7)
    before = snapshot(device_tensors(dev) + host_tensors(host))
    bad = torch.arange(24, 32)  # host pool holds slots [0, 24)
    with pytest.raises(IndexError, match=r"indices out of range: host \[24, 31\] of \[0, 24\)"):
        host.backup_from_device_all_layer(dev, bad, D, "direct")
    with pytest.raises(IndexError, match=r"device \[1000, 1007\] of \[0, 28\)"):
        host.load_to_device_per_layer(dev, H, torch.arange(1000, 1008), 0, "direct")
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(device_tensors(dev) + host_tensors(host))))


def test_validating_mode_checks_bounds_for_every_implementation(direct_only):
    dev = device_pool("mha", 4, pages=6)
    host = hc.make_host_pool(
        dev, layout="page_head", io_backend="reference", size=24, validate=True, registry=direct_only
    )
    with pytest.raises(IndexError, match=r"host_indices out of range: min 24, max 31, valid \[0, 24\)"):
        host.backup_from_device_all_layer(dev, torch.arange(24, 32), D, "reference")


def test_page_rows_need_whole_pages(direct_only):
    dev = device_pool("page_rows", 4, pages=6)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=24, registry=direct_only,
                             validate=True)  # fmt: skip
    fill_random(device_tensors(dev) + host_tensors(host), seed=7)
    before = snapshot(device_tensors(dev) + host_tensors(host))
    with pytest.raises(ValueError, match="indices must come in whole pages: got 6 slots with page_size 4"):
        host.backup_from_device_all_layer(dev, H[:6], D[:6], "direct")
    with pytest.raises(ValueError, match="host_indices must come in whole pages of 4 consecutive slots"):
        host.backup_from_device_all_layer(dev, H.flip(0), D, "direct")
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(device_tensors(dev) + host_tensors(host))))


def test_unknown_layout(direct_only):
    with pytest.raises(hc.UnsupportedCombinationError, match="Unknown layout 'page_last'. Registered layouts: "):
        hc.make_host_pool(device_pool("mha"), layout="page_last", io_backend="direct", registry=direct_only)


def test_none_device_pool(direct_only):
    with pytest.raises(ValueError, match="device_pool is None"):
        hc.make_host_pool(None, layout="layer_first", io_backend="direct", registry=direct_only)


def test_not_a_device_pool(direct_only):
    with pytest.raises(ValueError, match="cannot tell the pool kind of object"):
        hc.make_host_pool(object(), layout="layer_first", io_backend="direct", registry=direct_only)


def test_unknown_operation(direct_only):
    with pytest.raises(ValueError, match="unknown operation 'load'"):
        hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="direct", operations=["load"],
                          registry=direct_only)  # fmt: skip


def test_unpinned_host_memory_where_pinned_is_declared(direct_only):
    class NeedsPinned(hc.Implementation):
        name = "test.pinned"
        io_backend = "pinnedonly"
        device_types = frozenset({"cpu", "cuda"})
        needs_pinned_host = True

        def load_to_device_per_layer(self, h, d, layer):  # never reached
            raise AssertionError

        def backup_from_device_all_layer(self, h, d):
            raise AssertionError

        def backup_from_device_per_layer(self, h, d, layer):
            raise AssertionError

    class Plugin:
        @hc.hookimpl
        def hicache_register_backends(self, register):
            register(NeedsPinned)

    direct_only.add_plugin(Plugin(), "pinned")
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="pinnedonly", pin_memory=False,
                          registry=direct_only)  # fmt: skip
    assert "needs pinned host memory, but the host pool is not pinned (pin_memory=False, or no CUDA)" in str(err.value)


def test_refused_combination_lists_reasons_and_alternatives(direct_only):
    dev = device_pool("mha", 4)
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(dev, layout="page_first", io_backend="direct", registry=direct_only)
    e = err.value
    assert isinstance(e, ValueError)
    assert (e.io_backend, e.layout, e.pool_kind, e.operation) == ("direct", "page_first", "mha", hc.LOAD)
    text = str(e)
    assert text.startswith("No implementation of io backend 'direct' can run load_to_device_per_layer with:")
    assert "direct.copy_engine (plugin direct, priority 10):" in text
    assert "stores a layer's tokens strided on the host (token-major)" in text
    assert "layouts for io backend 'direct': 'layer_first', 'page_first_direct'" in text


@pytest.mark.parametrize(
    "kind, layout", [("mha", "page_first_kv_split"), ("page_rows", "page_head"), ("mla", "page_head")]
)
def test_layout_that_cannot_store_the_pool_kind(kind, layout, direct_only):
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(device_pool(kind), layout=layout, io_backend="direct", registry=direct_only)
    assert f"layout {layout!r} cannot store this {kind} pool: " in str(err.value)
    why = {"mha": "pool kind 'mha' declares no attribute to split its items at",
           "page_rows": "layout 'page_head' cannot store pool kind 'page_rows'",
           "mla": "layout 'page_head' cannot store pool kind 'mla'"}[kind]  # fmt: skip
    assert why in str(err.value)


def test_forcing_an_implementation_that_refuses(direct_only):
    with pytest.raises(hc.UnsupportedCombinationError) as err:
        hc.make_host_pool(device_pool("mha"), layout="page_head", io_backend="direct",
                          implementation="direct.copy_engine", registry=direct_only)  # fmt: skip
    assert str(err.value).startswith("The forced implementation 'direct.copy_engine' cannot run")


def test_forcing_an_unknown_implementation(direct_only):
    with pytest.raises(hc.UnsupportedCombinationError, match="Unknown implementation 'nope' was forced"):
        hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="direct", implementation="nope",
                          registry=direct_only)  # fmt: skip


def test_draft_pool_rows_must_be_shaped_like_the_targets(direct_only):
    dev = device_pool("mla", 4, pages=6)
    other = hc.MLADevicePool(24, 4, torch.bfloat16, 16, 4, 1, DEVICE)  # rows of 20 elements, not 24
    with pytest.raises(ValueError, match=r"draft pool kv_buffer\[0\] must match the target's kv_buffer\[0\]"):
        hc.make_host_pool(dev, layout="layer_first", io_backend="direct", draft_pools=[other], registry=direct_only)


@pytest.mark.parametrize("io_backend", ["direct", "reference"])
def test_a_smaller_draft_bounds_its_own_layer(io_backend, direct_only):
    dev = device_pool("mla", 4, pages=6)  # 28 rows
    small = device_pool("mla", 4, pages=1, layers=1)  # 8 rows
    host = hc.make_host_pool(dev, layout="layer_first", io_backend=io_backend, size=24, draft_pools=[small],
                             registry=direct_only)  # fmt: skip
    fill_random(device_tensors(dev) + device_tensors(small) + host_tensors(host), seed=7)
    before = snapshot(device_tensors(dev) + device_tensors(small) + host_tensors(host))
    rows = torch.arange(20, 24)  # inside the target's rows, past the draft's
    host.load_to_device_per_layer(dev, H[:4], rows, 1, io_backend)  # a target layer: fine
    with pytest.raises(IndexError, match=r"\[0, 8\)"):
        host.load_to_device_per_layer(small, H[:4], rows, 3, io_backend, is_draft=True)
    with pytest.raises(IndexError, match=r"\[0, 8\)"):
        host.backup_from_device_all_layer(dev, H[:4], rows, io_backend)
    after = snapshot(device_tensors(small) + host_tensors(host))
    assert all(torch.equal(a, b) for a, b in zip(before[len(device_tensors(dev)) :], after))


def test_page_rows_page_size_must_be_the_devices(direct_only):
    with pytest.raises(ValueError, match="page_size=2 differs from the page_rows device pool's page_size=4"):
        hc.make_host_pool(device_pool("page_rows", 4), layout="layer_first", io_backend="direct", page_size=2,
                          registry=direct_only)  # fmt: skip


def test_page_rows_reject_runs_off_a_page_start_even_without_validation(direct_only):
    dev = device_pool("page_rows", 4, pages=6)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=24, registry=direct_only)
    fill_random(device_tensors(dev) + host_tensors(host), seed=7)
    before = snapshot(device_tensors(dev) + host_tensors(host))
    with pytest.raises(ValueError, match="host_indices must come in whole pages"):
        host.backup_from_device_all_layer(dev, torch.arange(2, 10), D, "direct")
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(device_tensors(dev) + host_tensors(host))))


def test_negative_alloc(direct_only):
    host = hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="direct", registry=direct_only)
    with pytest.raises(ValueError, match="alloc\\(\\) takes a size >= 0"):
        host.alloc(-4)


def test_implementation_mapping_with_an_unknown_operation(direct_only):
    with pytest.raises(ValueError, match="unknown operation 'load'"):
        hc.make_host_pool(device_pool("mha"), layout="layer_first", io_backend="direct",
                          implementation={"load": "reference"}, registry=direct_only)  # fmt: skip


def test_reference_rejects_out_of_range_before_moving_anything(direct_only):
    dev = device_pool("mha", 4, pages=6)
    host = hc.make_host_pool(dev, layout="page_head", io_backend="reference", size=24, registry=direct_only)
    fill_random(device_tensors(dev) + host_tensors(host), seed=7)
    before = snapshot(device_tensors(dev) + host_tensors(host))
    with pytest.raises(IndexError, match=r"host indices out of range \[0, 24\): min -1"):
        host.backup_from_device_all_layer(dev, torch.tensor([-1, 0, 1, 2]), D[:4], "reference")
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(device_tensors(dev) + host_tensors(host))))


# ---- device pools validate their arguments as host pools do -------------------------------------


@pytest.mark.parametrize("kwargs, error, message", [
    ({"page_size": 0}, ValueError, r"^page_size must be >= 1, got 0$"),
    ({"page_size": -4}, ValueError, r"^page_size must be >= 1, got -4$"),
    ({"page_size": 2.5}, TypeError, r"^page_size must be an int, got float 2\.5$"),
    ({"size": -5}, ValueError, r"^size \(device token slots\) must be >= 1, got -5$"),
    ({"size": True}, TypeError, r"^size \(device token slots\) must be an int, got bool True$"),
    ({"head_num": 0}, ValueError, r"^head_num must be >= 1, got 0$"),
    ({"v_head_dim": "8"}, TypeError, r"^v_head_dim must be an int, got str '8'$"),
    ({"layer_num": 0}, ValueError, r"^layer_num must be >= 1, got 0$"),
    ({"start_layer": 1.0}, TypeError, r"^start_layer must be an int, got float 1\.0$"),
    ({"dtype": "bfloat16"}, TypeError, r"^dtype must be a torch\.dtype, got str 'bfloat16'$"),
])  # fmt: skip
def test_device_pools_refuse_bad_arguments_before_allocating(kwargs, error, message):
    args = {"size": 64, "page_size": 16, "dtype": torch.bfloat16, "head_num": 2, "head_dim": 8, "layer_num": 2,
            "device": "cpu", **kwargs}  # fmt: skip
    with pytest.raises(error, match=message):
        hc.MHADevicePool(**args)


def test_mla_and_page_row_pools_refuse_bad_arguments_too():
    with pytest.raises(ValueError, match=r"^kv_lora_rank must be >= 1, got 0$"):
        hc.MLADevicePool(64, 16, torch.bfloat16, 0, 64, 2, "cpu")
    with pytest.raises(TypeError, match=r"^page_size must be an int, got float 2\.5$"):
        hc.MLADevicePool(64, 2.5, torch.bfloat16, 512, 64, 2, "cpu")
    with pytest.raises(ValueError, match=r"^num_pages must be >= 1, got -1$"):
        hc.PageRowsDevicePool(-1, 16, 24, 2, "cpu")
    with pytest.raises(ValueError, match=r"^row_bytes must be >= 1, got 0$"):
        hc.PageRowsDevicePool(4, 16, 0, 2, "cpu")
