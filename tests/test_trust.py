"""Nothing silently wrong: each defect of the trust review, with the behaviour that replaced it.

Every test here failed on main at 95df5f0 (the review's commit) and passes now.
"""

from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch
from core_helpers import DEVICE, device_pool, device_tensors, fill_random, host_tensors, snapshot

import hicache_core as hc
from hicache_core import Implementation, Layout, hookimpl
from hicache_core.plugins.registry import Registry

# ---- 1. aliases follow the component axis wherever it is --------------------------------------------------


def _page_blob_registry() -> Registry:
    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register):
            register(Layout("blob_like", ("page", "component", "layer", "token", "head", "dim")))

    registry = Registry.from_entry_points({"direct"})
    registry.add_plugin(Plugin(), "bloblike")
    return registry


def test_k_and_v_aliases_select_the_component_axis_wherever_it_is():
    registry = _page_blob_registry()
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="blob_like", io_backend="direct", size=24, registry=registry)
    assert tuple(host.kv_buffer.shape) == (6, 2, 3, 4, 2, 8)
    assert tuple(host.k_buffer.shape) == (6, 3, 4, 2, 8) and tuple(host.v_buffer.shape) == (6, 3, 4, 2, 8)
    assert host.k_buffer.data_ptr() == host.kv_buffer[:, 0].data_ptr()
    assert host.v_buffer.data_ptr() == host.kv_buffer[:, 1].data_ptr()
    fill_random(device_tensors(dev), seed=3)
    slots = torch.arange(4, 8)
    host.backup_from_device_all_layer(dev, slots, torch.arange(8, 12), "direct")
    for layer in range(3):
        assert torch.equal(host.k_buffer[1, layer], dev.k_buffer[layer][8:12].cpu())
        assert torch.equal(host.v_buffer[1, layer], dev.v_buffer[layer][8:12].cpu())
    # and where K/V is outermost, as in SGLang: k_buffer = kv_buffer[0]
    host = hc.make_host_pool(dev, layout="page_first", io_backend="reference", size=24, registry=registry)
    assert host.k_buffer.shape == host.kv_buffer[0].shape and host.k_buffer.data_ptr() == host.kv_buffer.data_ptr()


# ---- 2. destroy() returns the memory, and every later call says so ----------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm to read the RSS")
def test_destroy_returns_the_host_memory_and_every_later_call_raises(direct_only):
    dev = hc.MLADevicePool(64, 64, torch.bfloat16, 512, 64, 32, "cpu")
    host = hc.make_host_pool(dev, layout="page_first", io_backend="reference", size=64 * 1024, registry=direct_only)
    nbytes = sum(t.numel() * t.element_size() for t in host.plan.host_buffers.values())
    assert nbytes > 2**30  # 64 Ki tokens x 32 layers x 1152 B
    for buffer in host.plan.host_buffers.values():
        buffer.view(torch.uint8).fill_(1)  # touch every page, so the RSS counts it
    del buffer  # the test's own reference would keep one alive
    host.load_to_device_per_layer(dev, torch.arange(64), torch.arange(64), 0, "reference")
    held = _rss()
    host.destroy()
    gc.collect()
    assert held - _rss() > 0.9 * nbytes, "destroy() left the host buffers allocated"
    for call in (
        lambda: host.load_to_device_per_layer(dev, torch.arange(64), torch.arange(64), 0, "reference"),
        lambda: host.backup_from_device_all_layer(dev, torch.arange(64), torch.arange(64), "reference"),
        lambda: host.alloc(64),
        lambda: host.free(torch.arange(64)),
        lambda: host.available_size(),
        lambda: host.get_data_page(0),
        lambda: host.get_page_buffer_meta(torch.arange(64)),
        lambda: host.implementation_for(hc.LOAD),
        lambda: host.check_dropped(),
    ):
        with pytest.raises(RuntimeError, match="this host pool was destroyed"):
            call()
    host.destroy()  # twice is fine


# ---- 3. masked indices are reported at the next call, naming the faulty one --------------------------------


class MaskingCopy(Implementation):
    """Moves the valid pairs and masks the rest, reporting them the way hicache's kernels do."""

    name = "trust.masking"
    io_backend = "masking"
    device_types = frozenset({"cpu", "cuda"})
    index_dtypes = frozenset({torch.int32, torch.int64})

    def _move(self, h, d, layers, to_device):
        rows = min(self.plan.device_rows_per_layer[layer] for layer in layers)
        ok = (h >= 0) & (h < self.plan.num_items) & (d >= 0) & (d < rows)
        if not bool(ok.all()):
            report = self.plan.drop_report
            ctypes.c_int64.from_address(report.address).value = report.seq
        hc.reference_copy(self.plan, h[ok], d[ok], layers, to_device=to_device)

    def load_to_device_per_layer(self, h, d, layer):
        self._move(h, d, [layer], True)

    def backup_from_device_per_layer(self, h, d, layer):
        self._move(h, d, [layer], False)

    def backup_from_device_all_layer(self, h, d):
        self._move(h, d, range(self.plan.num_layers), False)


@pytest.fixture
def masking_registry():
    class Plugin:
        @hookimpl
        def hicache_register_backends(self, register):
            register(MaskingCopy)

    registry = Registry()
    registry.add_plugin(Plugin(), "masking")
    return registry


def test_masked_indices_are_reported_at_the_next_call_naming_the_faulty_one(masking_registry):
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="masking", size=24, registry=masking_registry)
    good = torch.arange(4, 8)
    host.load_to_device_per_layer(dev, good, good, 1, "masking")  # call #1
    host.load_to_device_per_layer(dev, torch.tensor([4, 5, 6, 99]), good, 2, "masking")  # call #2: returns
    with pytest.raises(hc.DroppedIndicesError) as err:
        host.backup_from_device_all_layer(dev, good, good, "masking")
    assert err.value.call == 2 and err.value.operation == hc.LOAD and err.value.layer_id == 2
    assert isinstance(err.value, IndexError)
    assert "call #2 on this host pool (load_to_device_per_layer, layer_id 2, 4 indices)" in str(err.value)
    assert "stale bytes" in str(err.value) and "HICACHE_VALIDATE=1" in str(err.value)
    host.backup_from_device_all_layer(dev, good, good, "masking")  # reported once; then the pool works
    host.load_to_device_per_layer(dev, torch.tensor([-1, 5, 6, 7]), good, 0, "masking")
    with pytest.raises(hc.DroppedIndicesError, match="call #4"):  # the call that raised was never numbered
        host.check_dropped()


# ---- 4. free() takes whole pages only; 7. and says what is wrong ---------------------------------------------


def test_free_refuses_torn_pages_and_names_the_problem(direct_only):
    host = hc.make_host_pool(device_pool("mha", 4), layout="layer_first", io_backend="direct", size=24,
                             registry=direct_only)  # fmt: skip
    slots = host.alloc(8)
    with pytest.raises(ValueError, match=r"free\(\) takes whole pages .* starting \[1, 2, 3, 4\]"):
        host.free(torch.tensor([1, 2, 3, 4]))
    assert host.available_size() == 16  # nothing was freed
    with pytest.raises(ValueError, match=r"slots \[8, 9, 10, 11\] were never allocated"):
        host.free(torch.arange(8, 12))
    host.free(slots)
    with pytest.raises(ValueError, match=r"double free: slots \[0, 1, 2, 3, 4, 5, 6, 7\] were already freed"):
        host.free(slots)
    again = host.alloc(12)
    assert again.numel() == 12 and bool((again.reshape(-1, 4)[:, 0] % 4 == 0).all())
    assert bool((again.reshape(-1, 4) - again.reshape(-1, 4)[:, :1] == torch.arange(4)).all())


@pytest.mark.parametrize("bad, error", [(8.0, TypeError), (True, TypeError), ("8", TypeError), (-4, ValueError)])
def test_alloc_refuses_non_integers_with_a_clear_error(bad, error, direct_only):
    host = hc.make_host_pool(device_pool("mha", 4), layout="layer_first", io_backend="direct", size=24,
                             registry=direct_only)  # fmt: skip
    with pytest.raises(error, match=r"alloc\(\)"):
        host.alloc(bad)


# ---- 5. nothing coerced at construction ------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -8])
def test_a_size_that_is_not_positive_is_refused(size, direct_only):
    with pytest.raises(ValueError, match=r"size \(host capacity in tokens\) must be >= 1"):
        hc.make_host_pool(device_pool("mha", 4), layout="layer_first", io_backend="direct", size=size,
                          registry=direct_only)  # fmt: skip


@pytest.mark.parametrize("size, error", [(24.0, TypeError), (True, TypeError)])
def test_a_size_that_is_not_an_int_is_refused(size, error, direct_only):
    with pytest.raises(error, match="size .* must be an int"):
        hc.make_host_pool(device_pool("mha", 4), layout="layer_first", io_backend="direct", size=size,
                          registry=direct_only)  # fmt: skip


def test_a_device_page_size_of_zero_is_refused(direct_only):
    dev = device_pool("mha", 4)
    dev.page_size = 0
    with pytest.raises(ValueError, match="the device pool's page_size must be >= 1, got 0"):
        hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=24, registry=direct_only)


def test_a_fractional_page_size_is_a_clear_type_error(direct_only):
    with pytest.raises(TypeError, match="page_size must be an int, got float 2.5"):
        hc.make_host_pool(device_pool("mha", 4), layout="layer_first", io_backend="direct", size=24, page_size=2.5,
                          registry=direct_only)  # fmt: skip


@pytest.mark.parametrize("io_backend", ["direct", "kernel", "reference"])
def test_zero_heads_is_refused_the_same_way_for_every_io_backend(io_backend, registry):
    with pytest.raises(ValueError, match=r"^head_num must be >= 1, got 0$"):  # hicache's own pools refuse it at once
        hc.MHADevicePool(24, 4, torch.bfloat16, 0, 8, 3, DEVICE)
    # A server's pool reaches the host pool as it is: rows of zero heads.
    dev = hc.MHADevicePool(24, 4, torch.bfloat16, 1, 8, 3, DEVICE)
    dev.head_num = 0
    dev.k_buffer = [torch.zeros(28, 0, 8, dtype=torch.bfloat16, device=DEVICE) for _ in range(3)]
    dev.v_buffer = [torch.zeros(28, 0, 8, dtype=torch.bfloat16, device=DEVICE) for _ in range(3)]
    with pytest.raises(ValueError, match=r"k_buffer\[0\] has an empty row \(shape \(28, 0, 8\)\)"):
        hc.make_host_pool(dev, layout="layer_first", io_backend=io_backend, size=24, registry=registry)


@pytest.mark.parametrize("ratio", [0, -1.0, True, "2"])
def test_a_bad_host_to_device_ratio_is_refused(ratio, direct_only):
    with pytest.raises(ValueError, match="host_to_device_ratio must be a number > 0"):
        hc.make_host_pool(device_pool("mha", 4), layout="layer_first", io_backend="direct",
                          host_to_device_ratio=ratio, registry=direct_only)  # fmt: skip


# ---- 6. page meta: whole aligned integer pages, K and V of a layer together for every kind ----------------------


@pytest.fixture
def meta_host(direct_only):
    return hc.make_host_pool(device_pool("mha", 4), layout="layer_first", io_backend="reference", size=24,
                             registry=direct_only)  # fmt: skip


@pytest.mark.parametrize(
    "indices, error, match",
    [
        (torch.arange(2, 6), ValueError, "whole pages of 4 consecutive slots starting at a page start"),
        (torch.tensor([4, 9, 9, 9]), ValueError, "whole pages of 4"),
        (torch.arange(4, 8).float(), TypeError, "must be int32 or int64 token slots, got torch.float32"),
        (torch.ones(4, dtype=torch.bool), TypeError, "got torch.bool"),
        (torch.arange(24, 28), IndexError, "outside the pool"),
    ],
)
def test_page_buffer_meta_refuses_what_it_would_round(meta_host, indices, error, match):
    with pytest.raises(error, match=match):
        meta_host.get_page_buffer_meta(indices)


@pytest.mark.parametrize("index, error", [(6, ValueError), (4.0, TypeError), (True, TypeError), (24, IndexError)])
def test_data_pages_take_page_starts_only(meta_host, index, error):
    with pytest.raises(error):
        meta_host.get_data_page(index)


def test_page_buffer_meta_interleaves_separate_k_and_v_buffers_per_layer(direct_only):
    host = hc.make_host_pool(device_pool("mha_asym", 4), layout="layer_first", io_backend="reference", size=24,
                             registry=direct_only)  # fmt: skip
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(8, 12))
    k, v = host.k_buffer, host.v_buffer
    want = []
    for layer in range(3):
        want += [(k[layer, 8].data_ptr(), 4 * 2 * 8 * 2), (v[layer, 8].data_ptr(), 4 * 2 * 4 * 2)]
    assert list(zip(ptrs, sizes)) == want  # K0 V0 K1 V1 K2 V2, as SGLang lists them


# ---- 7. bad input that used to get a wrong or misleading answer ----------------------------------------------------


def test_page_item_slots_are_checked_whole_not_only_at_each_runs_start(direct_only):
    dev = device_pool("page_rows", 4)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=24, registry=direct_only)
    fill_random(device_tensors(dev) + host_tensors(host), seed=5)
    before = snapshot(device_tensors(dev) + host_tensors(host))
    with pytest.raises(ValueError, match="host_indices must come in whole pages of 4 consecutive slots"):
        host.backup_from_device_all_layer(dev, torch.tensor([4, 9, 9, 9]), torch.arange(8, 12), "direct")
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(device_tensors(dev) + host_tensors(host))))


def test_indices_on_the_meta_device_are_bad_input_not_a_plugin_error(direct_only):
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=24, registry=direct_only)
    meta = torch.empty(4, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="host_indices is on the meta device, which holds no values"):
        host.load_to_device_per_layer(dev, meta, torch.arange(4), 0, "direct")


def test_a_layer_this_rank_does_not_own_still_checks_its_indices(direct_only):
    dev = device_pool("mha", 4, sharded=True)  # owns layers [1, 3)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=24, registry=direct_only)
    with pytest.raises(TypeError, match="indices must be int32 or int64"):
        host.load_to_device_per_layer(dev, torch.arange(4).float(), torch.arange(4), 0, "direct")
    with pytest.raises(ValueError, match="1-D and of equal length"):
        host.load_to_device_per_layer(dev, torch.arange(4), torch.arange(3), 0, "direct")
    host.load_to_device_per_layer(dev, torch.arange(4), torch.arange(4), 0, "direct")  # a no-op, as SGLang's


def test_a_layer_this_rank_does_not_own_is_reported_under_validation(direct_only):
    dev = device_pool("mha", 4, sharded=True)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=24, validate=True,
                             registry=direct_only)  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"layer_id 0 is not owned by this rank \(it owns layers \[1, 3\) of 3; hicache's layer ids "
        r"are absolute\)",
    ):
        host.load_to_device_per_layer(dev, torch.arange(4), torch.arange(4), 0, "direct")


@pytest.mark.parametrize("layer_id", [True, False, 1.0])
def test_layer_id_must_be_an_int_not_a_bool_or_float(layer_id, direct_only):
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=24, registry=direct_only)
    with pytest.raises(TypeError, match="layer_id must be an int"):
        host.load_to_device_per_layer(dev, torch.arange(4), torch.arange(4), layer_id, "direct")


# ---- 9. CPU indices go through untouched; conversions happen once per index tensor ----------------------------------


class Recorder(Implementation):
    """Records the index tensors it is handed."""

    name = "trust.recorder"
    io_backend = "recorder"
    device_types = frozenset({"cpu", "cuda"})
    index_dtypes = frozenset({torch.int64})
    seen: list = []

    def load_to_device_per_layer(self, h, d, layer):
        type(self).seen.append((h, d))

    def backup_from_device_per_layer(self, h, d, layer):
        type(self).seen.append((h, d))

    def backup_from_device_all_layer(self, h, d):
        type(self).seen.append((h, d))


class Recorder32(Recorder):
    name = "trust.recorder32"
    io_backend = "recorder32"
    index_dtypes = frozenset({torch.int32, torch.int64})


@pytest.fixture
def recorders():
    class Plugin:
        @hookimpl
        def hicache_register_backends(self, register):
            register(Recorder)
            register(Recorder32)

    registry = Registry()
    registry.add_plugin(Plugin(), "recorders")
    Recorder.seen = []
    return registry


def test_cpu_indices_in_a_wanted_dtype_reach_the_implementation_with_no_copy(recorders):
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="recorder32", size=24, registry=recorders)
    h, d = torch.arange(4, 8, dtype=torch.int32), torch.arange(8, 12, dtype=torch.int64)
    host.load_to_device_per_layer(dev, h, d, 0, "recorder32")
    assert Recorder.seen[-1][0] is h and Recorder.seen[-1][1] is d


def test_an_index_conversion_happens_once_per_index_tensor_and_again_after_it_changes(recorders):
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="recorder", size=24, registry=recorders)
    h = torch.arange(4, 8, dtype=torch.int32)  # the implementation wants int64
    d = torch.arange(8, 12)
    for layer in range(3):
        host.load_to_device_per_layer(dev, h, d, layer, "recorder")
    converted = [seen[0] for seen in Recorder.seen]
    assert converted[0].dtype == torch.int64 and converted[0].tolist() == [4, 5, 6, 7]
    assert converted[1] is converted[0] and converted[2] is converted[0]  # one conversion for three layers
    h[0] = 12  # an in-place change bumps the version: converted again, never stale
    host.load_to_device_per_layer(dev, h, d, 0, "recorder")
    assert Recorder.seen[-1][0].tolist() == [12, 5, 6, 7]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: indices on the GPU for a CPU-index backend")
def test_gpu_indices_for_a_cpu_index_backend_are_copied_once_into_pinned_memory(recorders):
    dev = device_pool("mha", 4)
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="recorder", size=24, registry=recorders)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the caller's stream is busy: a blocking copy on it would wait for this
        d = torch.arange(8, 12, device="cuda")
        h = torch.arange(4, 8)
        for layer in range(3):
            host.load_to_device_per_layer(dev, h, d, layer, "recorder")
    converted = [seen[1] for seen in Recorder.seen]
    assert converted[0].device.type == "cpu" and converted[0].is_pinned() and converted[0].tolist() == [8, 9, 10, 11]
    assert converted[1] is converted[0] and converted[2] is converted[0]
