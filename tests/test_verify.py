"""Host-tier verification: the checksum's definition and guarantees, the kernel against it, detection, L3 carriage."""

from __future__ import annotations

import os
import struct

import pytest
import torch
from core_helpers import DEVICE, device_pool, fill_random

import hicache_core as hc
import hicache_core.verification.verify
from hicache_core.loads.layer_loads import LayerLoadError
from hicache_core.storage import PageStatus, make_storage
from hicache_core.storage.page_format import HEADER_SIZE
from hicache_core.verification import check_batch
from hicache_core.verification.page_checksum import (
    GROUP_TOKENS,
    M2,
    NO_CHECKSUM,
    checksum_bytes_reference,
    checksum_rows,
    seed,
)
from hicache_core.verification.verify import PageVerificationError

LAYERS = 3
CASES = [("mha", "page_first"), ("mha", "layer_first"), ("mha_asym", "page_first_direct"), ("mla", "page_first"),
         ("mla", "page_first_kv_split"), ("mla", "layer_first"), ("page_rows", "page_first")]  # fmt: skip


def _pool(kind: str, layout: str, page_size: int = 4, **kw):
    dp = device_pool(kind, page_size, pages=6)
    fill_random([t for c in hc.pool.host_pool.pool_kind_of(dp).components for t in getattr(dp, c.device_attr)], seed=3)
    host = hc.make_host_pool(dp, layout=layout, io_backend="auto", verify=True, **kw)
    return dp, host


def _device_page_bytes(dp, kind: str, layer: int, comp: int, device_rows: torch.Tensor) -> bytes:
    """The oracle's bytes of one page: the server's device rows, in page order (SGLang's shapes)."""
    attr = hc.pool.host_pool.pool_kind_of(dp).components[comp].device_attr
    rows = getattr(dp, attr)[layer][device_rows.to(DEVICE)]
    return rows.contiguous().cpu().view(torch.uint8).reshape(-1).numpy().tobytes()


# ---- the definition -----------------------------------------------------------------------------


def test_torch_checksum_is_the_definition():
    gen = torch.Generator().manual_seed(1)
    for tokens, row_bytes in ((4, 32), (64, 2048), (1, 8448), (12, 1152)):
        rows = torch.randint(0, 256, (2 * tokens, row_bytes), dtype=torch.uint8, generator=gen)
        got = checksum_rows(rows, 5, 1, tokens)
        for page in range(2):
            data = rows[page * tokens : (page + 1) * tokens].numpy().tobytes()
            assert got[page].tolist() == checksum_bytes_reference(data, 5, 1, row_bytes, tokens)
    # By hand, for two words of one row: w0 * s + w1 * (s + M2), mod 2**64.
    rows = torch.tensor([[1, 0, 0, 0, 2, 0, 0, 0]], dtype=torch.uint8)
    s = seed(0, 0) % (1 << 64)
    want = (1 * s + 2 * ((s + M2) % (1 << 64))) % (1 << 64)
    assert checksum_rows(rows, 0, 0, 1)[0, 0].item() % (1 << 64) == want


def test_every_flipped_bit_swapped_words_components_and_layers_change_the_checksum():
    gen = torch.Generator().manual_seed(2)
    tokens, row_bytes = 8, 64
    rows = torch.randint(0, 256, (tokens, row_bytes), dtype=torch.uint8, generator=gen)
    base = checksum_rows(rows, 2, 0, tokens)
    for byte in range(tokens * row_bytes):  # every bit of the page
        for bit in range(8):
            bad = rows.clone().reshape(-1)
            bad[byte] ^= 1 << bit
            assert not torch.equal(checksum_rows(bad.view(tokens, row_bytes), 2, 0, tokens), base)
    swapped = rows.clone()
    swapped[[1, 6]] = rows[[6, 1]]  # two tokens exchanged
    assert not torch.equal(checksum_rows(swapped, 2, 0, tokens), base)
    assert not torch.equal(checksum_rows(rows, 2, 1, tokens), base)  # the same bytes as another component
    assert not torch.equal(checksum_rows(rows, 3, 0, tokens), base)  # ... or another layer
    assert GROUP_TOKENS == 8 and checksum_rows(torch.zeros(64, 8, dtype=torch.uint8), 0, 0, 64).shape == (1, 8)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or DEVICE != "cpu", reason="the kernel on CPU pools")
def _every_kind_page_first():
    from hicache_core.plugins.registry import get_registry

    return [(k, "page_first") for k in get_registry().pool_kinds if (k, "page_first") not in CASES]


# Every registered kind in page_first, where every kind may be stored: a page kind's page is one row, read
# along the row in one tile whatever the widths of its components (Mamba's two differ).
@pytest.mark.parametrize("kind,layout", CASES[:1] + CASES[3:5] + CASES[6:] + _every_kind_page_first())
def test_kernel_matches_the_torch_definition(kind, layout):
    pytest.importorskip("triton")
    dp, host = _pool(kind, layout)
    kernel = host.verification.make_verifier(kernel=True)
    slots = host.alloc(12)
    dev = torch.arange(host.page_size, host.page_size + 12)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")  # the torch path fills host.verifier.table
    h, d = (
        (slots, dev)
        if not host.geometry.items_are_pages
        else (slots[:: host.page_size] // host.page_size, dev[:: host.page_size] // host.page_size)
    )
    kernel.backup(h, d, None, 1)
    _sync()  # on CUDA both tables are written by kernels still running: pinned memory, read by the host
    assert torch.equal(kernel.table, host.verifier.table) and host.verifier.table.any()
    kernel.check(h, d, 1, 2)
    assert not kernel.flagged()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or DEVICE != "cpu", reason="the kernel on CPU pools")
@pytest.mark.parametrize("page_size", [1, 12, 72])
def test_kernel_tiles_pages_of_any_size_as_the_definition_groups_them(page_size):
    # 1: a page is one group of one item; 12: two groups, the second half full; 72: two tiles of rows.
    pytest.importorskip("triton")
    dp, host = _pool("mha", "page_first", page_size=page_size)
    kernel = host.verification.make_verifier(kernel=True)
    slots = host.alloc(2 * page_size)
    dev = torch.arange(page_size, 3 * page_size)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    kernel.backup(slots, dev, None, 1)
    assert kernel.table.shape[-1] == -(-page_size // GROUP_TOKENS)
    assert torch.equal(kernel.table, host.verifier.table) and host.verifier.table.any()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or DEVICE != "cpu", reason="the kernel on CPU pools")
@pytest.mark.parametrize("rows", ["mha 2x40", "mla 512+64", "mha 8x128", "page rows 2088"])
def test_kernel_sums_rows_wider_than_its_tile_as_the_definition(rows):
    # 64-token pages take tiles of 64 rows by 32 words. 40 words: a full tile of words and a part of one; 288
    # (MLA's 576 bf16): nine; 512 (llama's 8 x 128): sixteen. A page kind's page is one row, read 512 words
    # at a time: 2088 words, four full tiles and a part of one.
    pytest.importorskip("triton")
    page_kind = rows.startswith("page")
    if page_kind:
        dp = hc.PageRowsDevicePool(6, 4, 4 * int(rows.split()[-1]), 2, DEVICE)
    elif rows.startswith("mla"):
        dp = hc.MLADevicePool(6 * 64, 64, torch.bfloat16, 512, 64, 2, DEVICE)
    else:
        heads, dim = (int(x) for x in rows.split()[1].split("x"))
        dp = hc.MHADevicePool(6 * 64, 64, torch.bfloat16, heads, dim, 2, DEVICE)
    fill_random([t for c in hc.pool.host_pool.pool_kind_of(dp).components for t in getattr(dp, c.device_attr)], seed=5)
    host = hc.make_host_pool(dp, layout="page_first", io_backend="auto", verify=True)
    kernel = host.verification.make_verifier(kernel=True)
    assert kernel._tile == ((1, 1, 512) if page_kind else (64, GROUP_TOKENS, 32))
    assert kernel._pages_per_program == 1  # rows wider than a step: a program a page
    assert kernel._tile[2] < max(kernel.words)  # the word loop runs more than once
    p = host.page_size
    slots = host.alloc(2 * p)
    dev = torch.arange(p, 3 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")  # the torch definition (a CPU pool's verifier)
    # What the pool hands its verifier: a page kind's indices are its page rows.
    h, d = (slots.reshape(-1, p)[:, 0] // p, dev.reshape(-1, p)[:, 0] // p) if page_kind else (slots, dev)
    kernel.backup(h, d, None, 1)
    _sync()  # on CUDA both tables are written by kernels still running: pinned memory, read by the host
    assert torch.equal(kernel.table, host.verifier.table) and host.verifier.table.any()
    kernel.check(h, d, 1, 2)
    assert not kernel.flagged()
    # The last word of the first loaded page's last device row (a page kind's row is its page).
    row = 1 if page_kind else 2 * p - 1
    getattr(dp, hc.pool.host_pool.pool_kind_of(dp).components[0].device_attr)[1][row].view(torch.uint8)[-1] ^= 0x10
    kernel.check(h, d, 1, 3)  # the pool's last layer ends the run: checked now, on the CPU
    assert kernel.flagged()
    with pytest.raises(PageVerificationError) as info:
        kernel.raise_if_failed()
    assert info.value.pages == [int(slots[0]) // p]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or DEVICE != "cpu", reason="the kernel on CPU pools")
@pytest.mark.parametrize("kind", ["kv_scale_pages", "page_rows"])
def test_a_program_of_several_pages_checks_each_and_names_only_the_flipped_one(kind):
    # Pages of one row are checked four to a program: a call of six pages is two programs, the second half
    # empty. The host pages are taken out of order, and one flipped byte names its own page and no other.
    pytest.importorskip("triton")
    dp = device_pool(kind, 4, pages=8, layers=2)
    comps = hc.pool.host_pool.pool_kind_of(dp).components
    fill_random([t for c in comps for t in getattr(dp, c.device_attr)], seed=9)
    host = hc.make_host_pool(dp, layout="page_first", io_backend="auto", verify=True, size=4 * 12)
    kernel = host.verification.make_verifier(kernel=True)
    assert kernel._pages_per_program == 4
    p = host.page_size
    slots = host.alloc(8 * p).reshape(-1, p)[[5, 0, 7, 2, 3, 6]].reshape(-1)
    dev = torch.arange(p, 7 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")  # the torch definition (a CPU pool's verifier)
    h, d = slots.reshape(-1, p)[:, 0] // p, dev.reshape(-1, p)[:, 0] // p
    kernel.backup(h, d, None, 1)
    assert torch.equal(kernel.table, host.verifier.table) and host.verifier.table.any()
    kernel.check(h, d, 1, 2)
    assert not kernel.flagged()
    # The fifth page of the call (the second program's first) loses one bit of its second component's row.
    getattr(dp, comps[-1].device_attr)[1][5].view(torch.uint8)[7] ^= 0x01
    kernel.check(h, d, 1, 3)
    assert kernel.flagged()
    with pytest.raises(PageVerificationError) as info:
        kernel.raise_if_failed()
    assert info.value.pages == [int(h[4])]


def _record_checked_layers(host) -> list[list[int]]:
    """The layers of each batched check the pool's verifier launches from now on, in order."""
    calls: list[list[int]] = []
    checked = host.verifier._check_layers

    def run(*args, **kwargs):
        calls.append(list(args[2]))
        return checked(*args, **kwargs)

    host.verifier._check_layers = run
    return calls


def test_a_load_is_checked_in_one_run_after_its_last_layer_or_in_the_runs_set(monkeypatch):
    assert check_batch.check_runs("copy_engine") == 1 and check_batch.check_runs("sm") == 1
    monkeypatch.setattr(check_batch, "CHECK_RUNS_COPY_ENGINE", 4)
    dp, host = _pool("mha", "page_first")
    calls = _record_checked_layers(host)
    slots = host.alloc(host.page_size)
    dev = torch.arange(host.page_size, 2 * host.page_size)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    batch = host.verifier.batch(8, "copy_engine")
    for layer in range(8):
        batch.add(slots, dev, layer % LAYERS, layer)
    batch.flush()
    assert calls == [[0, 1], [2, 0], [1, 2], [0, 1]]
    calls.clear()
    batch = host.verifier.batch(8, "sm")
    for layer in range(8):
        batch.add(slots, dev, layer % LAYERS, layer)
    assert calls == []  # one run: launched by flush (after the last layer's event), in order on the copies' stream
    batch.flush()
    assert calls == [[0, 1, 2, 0, 1, 2, 0, 1]]
    host.check_verified()


@pytest.mark.parametrize("with_kernel", [False, True])
def test_a_layer_wise_loads_checks_run_in_runs_of_layers_naming_each_failing_layers_call(with_kernel, monkeypatch):
    if with_kernel and (os.environ.get("TRITON_INTERPRET") != "1" or DEVICE != "cpu"):
        pytest.skip("the kernel on CPU pools: under TRITON_INTERPRET=1")
    dp, host = _pool("mha", "page_first")
    if with_kernel:
        host.verifier = host.verification.make_verifier(kernel=True, in_copy=False)  # checked apart, in runs
    p = host.page_size
    slots = host.alloc(3 * p)
    dev = torch.arange(p, 4 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    first, last = int(slots[0]) // p, int(slots[2 * p]) // p
    _flip_host_byte(host, first, layer=0)
    _flip_host_byte(host, last, layer=1, part=1)
    calls = _record_checked_layers(host)
    monkeypatch.setattr(check_batch, "CHECK_RUNS", 2)
    monkeypatch.setattr(check_batch, "CHECK_RUNS_COPY_ENGINE", 2)  # "auto" may be the copy engine on CUDA
    seq = host._drops.seq
    load = host.submit_load(dp, slots, dev, "auto")
    try:
        load.result()
    except LayerLoadError as exc:  # the first run's check ran before layer 2's call, which raised it
        assert "layer 2 failed to load" in str(exc)
        err = exc.__cause__
    else:  # on a GPU the check may run later: the next call reports it
        assert DEVICE != "cpu"
        _sync()
        with pytest.raises(PageVerificationError) as info:
            host.check_verified()
        err = info.value
    assert calls[0] == [0, 1]  # runs of ceil(3 / 2) layers, launched when their last layer's copies are enqueued
    assert isinstance(err, PageVerificationError)
    assert err.pages == [first, last] and err.layer_ids == [0, 1]
    assert [c[0] - seq for c in err.calls] == [1, 2]  # each layer's own call
    assert all(c[1] == "load_to_device_per_layer" for c in err.calls)
    assert f"host pages [{first}]" in str(err) and f"host pages [{last}]" in str(err)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or DEVICE != "cpu", reason="the kernel on CPU pools")
def test_a_load_of_every_layer_out_of_order_names_the_failing_layers_own_call():
    # Every layer, first 0 and last 3, but not in order: the batch's check must follow the load's order.
    pytest.importorskip("triton")
    dp = device_pool("mha", 4, pages=6, layers=4)
    fill_random([t for c in hc.pool.host_pool.pool_kind_of(dp).components for t in getattr(dp, c.device_attr)], seed=3)
    host = hc.make_host_pool(dp, layout="page_first", io_backend="auto", verify=True)
    host.verifier = host.verification.make_verifier(kernel=True)
    p = host.page_size
    slots = host.alloc(p)
    dev = torch.arange(p, 2 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    _flip_host_byte(host, int(slots[0]) // p, layer=2)
    seq = host._drops.seq
    load = host.submit_load(dp, slots, dev, "auto", layer_ids=[0, 2, 1, 3])
    try:
        load.result()
        host.check_verified()
    except LayerLoadError as exc:  # the check ran before a later layer's call, which raised it
        err = exc.__cause__
    except PageVerificationError as exc:
        err = exc
    else:
        pytest.fail("the flipped byte was not caught")
    assert isinstance(err, PageVerificationError)
    assert err.layer_ids == [2] and [c[0] - seq for c in err.calls] == [2]  # layer 2 was the load's second call


# ---- detection ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,layout", CASES)
def test_clean_round_trips_raise_nothing_and_checksums_match_the_oracle(kind, layout):
    dp, host = _pool(kind, layout)
    p = host.page_size
    slots = host.alloc(3 * p)
    dev = torch.arange(p, 4 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    _sync()
    tokens = 1 if host.geometry.items_are_pages else p
    for comp, geometry_comp in enumerate(host.geometry.components):
        row = getattr(dp, geometry_comp.attr)[0]
        row_bytes = row[0].numel() * row.element_size()
        for q in range(3):
            rows = dev[q * p : (q + 1) * p] if tokens > 1 else dev[q * p : q * p + 1] // p
            want = checksum_bytes_reference(_device_page_bytes(dp, kind, 1, comp, rows), 1, comp, row_bytes, tokens)
            assert host.verifier.table[int(slots[q * p]) // p, 1, comp].tolist() == want
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, slots, dev, layer, "auto")
    host.check_verified()
    assert host.verifier.failed_pages_total == 0 and host.take_failed_pages().numel() == 0


def _sync() -> None:
    """Wait for the device (on CUDA the backups and their checksums land in pinned memory later)."""
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def _backed_up_mha(layout: str = "page_first"):
    """An MHA pool (``layout``) with two pages backed up: ``(device pool, host pool, host slots, device rows)``."""
    dp, host = _pool("mha", layout)
    p = host.page_size
    slots = host.alloc(2 * p)
    dev = torch.arange(p, 3 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    _sync()
    return dp, host, slots, dev


def _flip_host_byte(host, page: int, layer: int, part: int = 0, at: int = 3) -> None:
    _sync()
    view = host.plan.parts[part].host_layer_view(layer)[page]  # a strided view into the host buffer
    t, h, b = at % view.shape[0], at % view.shape[1], (at * 7) % view.shape[2]
    view[t, h, b] ^= 0x10


@pytest.mark.parametrize("kind,layout", CASES)
def test_a_byte_flipped_in_host_memory_is_caught_naming_pages_layer_and_call(kind, layout):
    dp, host = _pool(kind, layout)
    p = host.page_size
    slots = host.alloc(3 * p)
    dev = torch.arange(p, 4 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    bad_page = int(slots[p]) // p  # the second page of the call
    _flip_host_byte(host, bad_page, layer=1, part=len(host.plan.parts) - 1)
    host.load_to_device_per_layer(dp, slots, dev, 0, "auto")  # layer 0 is clean
    host.load_to_device_per_layer(dp, slots, dev, 1, "auto")  # the bad layer: reported, not raised here
    host.load_to_device_per_layer(dp, slots, dev, 2, "auto")  # the last layer: the load's layers are checked
    _sync()  # the check runs on the device, behind the load: the first call after it ran raises
    with pytest.raises(PageVerificationError) as info:
        host.load_to_device_per_layer(dp, slots, dev, 0, "auto")  # the next call raises, before moving a byte
    err = info.value
    assert err.pages == [bad_page] and err.layer_ids == [1]
    assert err.calls[0][1:] == ("load_to_device_per_layer", 1)
    assert torch.equal(err.host_indices, torch.arange(bad_page * p, (bad_page + 1) * p))
    text = str(err)
    assert f"host pages [{bad_page}]" in text and "layer_id 1" in text and "load_to_device_per_layer" in text
    assert host.quarantined_pages() == {bad_page}
    assert host.verify_stats() == {"verify": 1, "failed_pages": 1, "failed_calls": 1, "quarantined_pages": 1}
    assert torch.equal(host.take_failed_pages(), err.host_indices)
    assert host.take_failed_pages().numel() == 0  # taken once
    host.load_to_device_per_layer(dp, slots, dev, 2, "auto")  # reported once; the pool goes on
    host.check_verified()  # (layer 2 alone is clean)
    host.free(slots)  # freeing the slots lifts the quarantine
    assert host.quarantined_pages() == set()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or DEVICE != "cpu", reason="the kernel on CPU pools")
def test_a_failing_layer_is_named_after_the_batch_numbers_wrapped_around_many_times(monkeypatch):
    # Batched checks write numbers of their own; the pool maps the newest back to calls in a ring of a fixed size.
    pytest.importorskip("triton")
    monkeypatch.setattr(hicache_core.verification.verify, "_BATCH_CALLS", 4)
    dp, host = _pool("mha", "page_first")
    host.verifier = host.verification.make_verifier(kernel=True, in_copy=False)  # checked apart, in batches
    p = host.page_size
    slots = host.alloc(p)
    dev = torch.arange(p, 2 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    for _ in range(4):  # 12 numbers through a ring of 4
        for layer in range(LAYERS):
            host.load_to_device_per_layer(dp, slots, dev, layer, "auto")
    host.check_verified()
    _flip_host_byte(host, int(slots[0]) // p, layer=1)
    seqs = []
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, slots, dev, layer, "auto")
        seqs.append(host._drops.seq)
    with pytest.raises(PageVerificationError) as info:
        host.check_verified()
    assert info.value.calls == [(seqs[1], "load_to_device_per_layer", 1)]
    assert host.verifier._call_of(-1) == -1  # a number too old to know is named as it is


def test_a_run_of_per_layer_loads_is_checked_after_its_last_layer_or_when_another_call_closes_it():
    dp, host = _pool("mha", "layer_first")
    p = host.page_size
    slots = host.alloc(2 * p)
    dev = torch.arange(p, 3 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    bad_page = int(slots[0]) // p
    _flip_host_byte(host, bad_page, layer=0)
    calls = []
    host.load_to_device_per_layer(dp, slots, dev, 0, "auto")  # the bad layer
    calls.append(host._drops.seq)
    host.load_to_device_per_layer(dp, slots, dev, 1, "auto")
    _sync()
    assert not host.verifier.flagged()  # the run is open: nothing is checked before its last layer ...
    host.load_to_device_per_layer(dp, slots, dev, 2, "auto")
    _sync()
    assert host.verifier.flagged()  # ... and then all of it, at once
    with pytest.raises(PageVerificationError) as info:
        host.check_verified()
    assert info.value.calls == [(calls[0], "load_to_device_per_layer", 0)] and info.value.pages == [bad_page]

    # A run that stops short is checked by the next call of another kind, or with other indices.
    other = host.alloc(p)
    host.backup_from_device_all_layer(dp, other, dev[:p], "auto")
    host.load_to_device_per_layer(dp, slots, dev, 0, "auto")
    host.load_to_device_per_layer(dp, other, dev[:p], 1, "auto")  # other indices: the first run closes
    _sync()
    assert host.verifier.flagged()
    with pytest.raises(PageVerificationError, match="layer_id 0"):
        host.check_verified()
    host.load_to_device_per_layer(dp, slots, dev, 0, "auto")
    host.backup_from_device_all_layer(dp, other, dev[:p], "auto")  # a backup closes it
    _sync()
    with pytest.raises(PageVerificationError, match="layer_id 0"):
        host.load_to_device_per_layer(dp, other, dev[:p], 0, "auto")
    host.load_to_device_per_layer(dp, slots, dev, 0, "auto")
    host.load_to_device_per_layer(dp, slots, dev, 2, "auto")  # not the next layer: a new run, the last layer
    with pytest.raises(PageVerificationError, match="layer_id 0"):
        host.check_verified()  # check_verified closes what is open
    host.check_verified()


def test_a_run_abandoned_on_an_error_is_checked_before_the_caller_can_reuse_its_rows():
    dp, host, slots, dev = _backed_up_mha()
    p = host.page_size
    host.load_to_device_per_layer(dp, slots, dev, 0, "auto")  # clean
    with pytest.raises(IndexError):
        host.load_to_device_per_layer(dp, slots, dev, LAYERS + 5, "auto")  # an error leaves the call: the run closes
    for t in dp.k_buffer + dp.v_buffer:  # the server frees the rows and reuses them
        t.zero_()
    host.check_verified()  # no false alarm: layer 0 was checked before the rows were reused

    # The same through the layer loader: a load whose layer 1 fails after layer 0 was loaded.
    fill_random(dp.k_buffer + dp.v_buffer, seed=3)
    bad_page = int(slots[p]) // p
    _flip_host_byte(host, bad_page, layer=0)
    impl = host.implementation_for("load_to_device_per_layer")
    copy = impl.load_to_device_per_layer

    def planted(h, d, layer):
        if layer == 1:
            raise RuntimeError("planted")
        copy(h, d, layer)

    impl.load_to_device_per_layer = planted
    try:
        load = host.submit_load(dp, slots, dev, "auto")
        with pytest.raises(LayerLoadError, match="planted"):
            load.result(10)  # the job ended
    finally:
        del impl.load_to_device_per_layer
    for t in dp.k_buffer + dp.v_buffer:
        t.zero_()
    with pytest.raises(PageVerificationError) as info:
        host.check_verified()  # the flipped byte, caught when the job ended, not the rows zeroed since
    assert info.value.pages == [bad_page] and info.value.layer_ids == [0]


def test_a_run_a_loader_step_leaves_open_is_checked_when_the_load_stops():
    """A caller's own step that loads layers itself and fails, or stops, before the pool's last layer leaves a run
    of per-layer loads open: it is checked when the load stops, before the consumers may reuse the rows (the GPU
    gate's stress found such a run checked later, against rows zeroed since: a false alarm)."""
    dp, host, slots, dev = _backed_up_mha()
    p = host.page_size
    bad_page = int(slots[p]) // p
    _flip_host_byte(host, bad_page, layer=0)

    def step(layer):
        if layer == 1:
            raise RuntimeError("planted")
        host.load_to_device_per_layer(dp, slots, dev, layer, "auto")

    load = hc.loads.layer_loads.layer_loader(DEVICE).submit(LAYERS, step, what="a failing job")
    with pytest.raises(LayerLoadError, match="planted"):
        load.result(10)
    # result() waits for the submission only: the wait before reusing a failed load's rows is the settle wait
    # (on CUDA the rows were zeroed before the copies ran, beside the gate's soak: a race of the test's own).
    assert load.wait_settled(10)
    for t in dp.k_buffer + dp.v_buffer:  # the caller reuses the rows
        t.zero_()
    with pytest.raises(PageVerificationError) as info:
        host.check_verified()  # the flipped byte, caught when the load stopped, not the rows zeroed since
    assert info.value.pages == [bad_page] and info.value.layer_ids == [0]

    # A job that loads one layer and ends without an error: its run is checked when it ends as well.
    slots = host.alloc(2 * p)
    fill_random(dp.k_buffer + dp.v_buffer, seed=7)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    _sync()
    short = hc.loads.layer_loads.layer_loader(DEVICE).submit(1, lambda layer: host.load_to_device_per_layer(
        dp, slots, dev, 0, "auto"), what="a short job")  # fmt: skip
    short.result(10)
    assert short.wait_settled(10)  # its copies and its check are through before the rows are reused
    for t in dp.k_buffer + dp.v_buffer:
        t.zero_()
    host.check_verified()  # no false alarm: layer 0 was checked when the job ended


def test_a_verifying_pool_refuses_part_of_a_page_before_any_byte_moves():
    dp, host, slots, dev = _backed_up_mha("layer_first")
    p = host.page_size
    before = [t.view(torch.uint8).clone() for t in dp.k_buffer + dp.v_buffer]  # random bytes: NaNs among them
    moved = rf"\(verify=True\), but a call moved {2 * p - 1} slots, part of a page \(page_size {p}\)"
    with pytest.raises(ValueError, match=moved):
        host.load_to_device_per_layer(dp, slots[:-1], dev[:-1], 0, "auto")
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, dp.k_buffer + dp.v_buffer))
    table = host.verifier.table.clone()
    with pytest.raises(ValueError, match=rf"a call moved {p + 1} slots, part of a page"):
        host.backup_from_device_all_layer(dp, slots[: p + 1], dev[: p + 1], "auto")
    with pytest.raises(ValueError, match=rf"a call moved {p - 1} slots, part of a page"):
        host.submit_load(dp, slots[: p - 1], dev[: p - 1], "auto")  # refused when submitted, not on the loader
    _sync()
    assert torch.equal(host.verifier.table, table)  # no checksum rewritten either
    host.check_verified()


def test_check_verified_raises_at_once_and_swapped_pages_are_caught():
    dp, host, slots, dev = _backed_up_mha()
    p = host.page_size
    a, b = (int(x) // p for x in slots[::p])
    views_a, views_b = host._page_views(a), host._page_views(b)
    for va, vb in zip(views_a, views_b):  # the two host pages' bytes exchanged (a transfer that misplaced them)
        saved = va.clone()
        va.copy_(vb)
        vb.copy_(saved)
    host.load_to_device_per_layer(dp, slots, dev, 0, "auto")
    with pytest.raises(PageVerificationError) as info:
        host.check_verified()
    assert info.value.pages == sorted((slots[::p] // p).tolist())


def test_per_layer_backups_are_verified_layer_by_layer():
    dp = device_pool("mha", 4, pages=6, sharded=True)
    fill_random(dp.k_buffer + dp.v_buffer, seed=4)
    host = hc.make_host_pool(dp, layout="layer_first", io_backend="auto", verify=True)
    slots, dev = host.alloc(8), torch.arange(4, 12)
    for layer in (1, 2):
        host.backup_from_device_per_layer(dp, slots, dev, layer, "auto")
    for layer in (1, 2):
        host.load_to_device_per_layer(dp, slots, dev, layer, "auto")
    host.check_verified()
    _flip_host_byte(host, int(slots[4]) // 4, layer=1)  # host layer 1 = model layer 2
    host.load_to_device_per_layer(dp, slots, dev, 2, "auto")
    with pytest.raises(PageVerificationError, match="layer_id 2"):
        host.check_verified()


def test_a_flat_page_set_by_the_server_gets_its_checksums_from_its_bytes():
    dp, host = _pool("mla", "page_first_kv_split")
    slots, dev = host.alloc(4), torch.arange(4, 8)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    _sync()
    page = host.get_data_page(int(slots[0]))
    other = host.alloc(4)
    host.set_from_flat_data_page(int(other[0]), page)
    assert torch.equal(host.verifier.table[int(other[0]) // 4], host.verifier.table[int(slots[0]) // 4])


# ---- bad input ----------------------------------------------------------------------------------


def test_verify_refuses_what_it_cannot_verify_at_construction(monkeypatch):
    dp = hc.PageRowsDevicePool(6, 4, 6, LAYERS, DEVICE)  # rows of 6 bytes: not whole 32-bit words
    with pytest.raises(ValueError, match="not a whole number of 32-bit words"):
        hc.make_host_pool(dp, layout="page_first", io_backend="auto", verify=True)
    hc.make_host_pool(dp, layout="page_first", io_backend="auto", verify=False)  # fine without
    good = device_pool("mha", 4)
    with pytest.raises(TypeError, match="verify must be True, False or None"):
        hc.make_host_pool(good, layout="page_first", io_backend="auto", verify="yes")
    monkeypatch.setenv("HICACHE_VERIFY", "1")
    assert hc.make_host_pool(good, layout="page_first", io_backend="auto").verify
    monkeypatch.setenv("HICACHE_VERIFY", "0")
    monkeypatch.setenv("HICACHE_VALIDATE", "1")  # validation does not imply verification
    assert not hc.make_host_pool(good, layout="page_first", io_backend="auto").verify


# ---- L3: the checksums travel with the page -----------------------------------------------------


def _stored(host, name: str):
    return make_storage(f"memory://verify-{name}-{os.getpid()}", host, model_id="m")


def test_a_failed_page_is_never_written_and_checksums_come_back_from_the_store():
    dp, host = _pool("mha", "page_first")
    p = host.page_size
    slots, dev = host.alloc(3 * p), torch.arange(p, 4 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    store = _stored(host, "a")
    store.clear()
    bad_page = int(slots[2 * p]) // p
    _flip_host_byte(host, bad_page, layer=0)
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, slots, dev, layer, "auto")
    keys = ["k0", "k1", "k2"]
    _sync()  # the device's report has landed (a server's L3 write waits for the backup's event likewise)
    results = store.write_pages(keys, slots)  # the failure is collected here, without a sync or a raise
    assert [r.status for r in results] == [PageStatus.OK, PageStatus.OK, PageStatus.CORRUPT]
    assert "failed host-tier verification" in results[2].detail
    assert store.backend.exists_objects(store.namespace.keys(keys)) == [True, True, False]
    with pytest.raises(PageVerificationError):
        host.check_verified()
    # Prefetch the good pages into other slots: their checksum rows land in the table with them.
    back = host.alloc(2 * p)
    rows_before = host.verifier.table[slots[: 2 * p : p] // p].clone()
    host.verifier.table[back[::p] // p] = 0
    assert all(r.ok for r in store.read_pages(keys[:2], back))
    assert torch.equal(host.verifier.table[back[::p] // p], rows_before)
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, back, dev[: 2 * p], layer, "auto")
    host.check_verified()  # device, host, store, host, device: clean
    # Bytes damaged after the prefetch are caught on the device against the original backup's checksums.
    _flip_host_byte(host, int(back[p]) // p, layer=2)
    host.load_to_device_per_layer(dp, back, dev[: 2 * p], 2, "auto")
    with pytest.raises(PageVerificationError) as info:
        host.check_verified()
    assert info.value.pages == [int(back[p]) // p] and info.value.layer_ids == [2]


def test_pages_of_another_format_version_or_verify_setting_read_as_mismatch():
    dp, host = _pool("mha", "page_first")
    plain = hc.make_host_pool(dp, layout="page_first", io_backend="auto", verify=False)
    slots = host.alloc(4)
    host.backup_from_device_all_layer(dp, slots, torch.arange(4, 8), "auto")
    _sync()
    store, other = _stored(host, "b"), _stored(plain, "b")
    store.clear()
    assert store.write_pages(["x"], slots)[0].ok
    got = other.read_pages(["x"], plain.alloc(4))[0]
    assert got.status is PageStatus.MISMATCH and "bytes" in got.detail  # another object size
    # A version-1 page (today's readers' format) is a mismatch, not corruption.
    key = store.namespace.key("x")
    blob = bytearray(store.backend.get_objects([key])[0])
    blob[4:6] = struct.pack("<H", 1)
    import zlib

    blob[HEADER_SIZE - 4 : HEADER_SIZE] = struct.pack("<I", zlib.crc32(bytes(blob[: HEADER_SIZE - 4])))
    store.backend.remove_objects([key])
    from hicache_core.storage.page_format import address_of
    from hicache_core.storage.pages import Span

    store.backend.put_objects([key], [[Span(address_of(blob), len(blob), memoryview(blob))]])
    old = store.read_pages(["x"], host.alloc(4))[0]
    assert old.status is PageStatus.MISMATCH and "version 1" in old.detail


def _rewrite(store, key: str, mutate) -> None:
    """Replace a stored object by a mutated copy of its bytes (a store that damaged it)."""
    from hicache_core.storage.page_format import address_of
    from hicache_core.storage.pages import Span

    blob = bytearray(store.backend.get_objects([key])[0])
    mutate(blob)
    store.backend.remove_objects([key])
    assert store.backend.put_objects([key], [[Span(address_of(blob), len(blob), memoryview(blob))]]) == [None]


def test_device_checked_pages_hash_only_the_row_on_the_host_and_are_caught_on_the_device():
    dp, host = _pool("mla", "page_first")
    p = host.page_size
    slots, dev = host.alloc(2 * p), torch.arange(p, 3 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    _sync()
    store = _stored(host, "c")
    store.clear()
    assert all(r.ok for r in store.write_pages(["a", "b"], slots))
    ka, kb = store.namespace.keys(["a", "b"])
    blob = store.backend.get_objects([ka])[0]
    assert struct.unpack_from("<HH", blob, 8) == (2, host.verifier.table[0].numel())  # device-checked, row words
    _rewrite(store, ka, lambda b: b.__setitem__(HEADER_SIZE + 100, b[HEADER_SIZE + 100] ^ 1))  # payload byte
    row_at = HEADER_SIZE + store.page_bytes + 3
    _rewrite(store, kb, lambda b: b.__setitem__(row_at, b[row_at] ^ 1))  # checksum-row byte
    back = host.alloc(2 * p)
    ra, rb = store.read_pages(["a", "b"], back)
    assert ra.ok  # the payload is not hashed on the host ...
    assert rb.status is PageStatus.CORRUPT and "checksum" in rb.detail  # ... the row is
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, back[:p], dev[:p], layer, "auto")
    with pytest.raises(PageVerificationError) as info:  # ... and the device catches the payload
        host.check_verified()
    assert info.value.pages == [int(back[0]) // p]


def test_l3_host_check_hashes_the_payload_on_the_host_too(monkeypatch):
    monkeypatch.setenv("HICACHE_L3_HOST_CHECK", "1")
    dp, host = _pool("mha", "page_first")
    slots = host.alloc(4)
    host.backup_from_device_all_layer(dp, slots, torch.arange(4, 8), "auto")
    _sync()
    store = _stored(host, "d")
    store.clear()
    assert store.write_pages(["a"], slots)[0].ok
    (key,) = store.namespace.keys(["a"])
    assert struct.unpack_from("<H", store.backend.get_objects([key])[0], 8) == (1,)
    _rewrite(store, key, lambda b: b.__setitem__(HEADER_SIZE + 5, b[HEADER_SIZE + 5] ^ 1))
    got = store.read_pages(["a"], host.alloc(4))[0]
    assert got.status is PageStatus.CORRUPT and "payload checksum" in got.detail


def test_parallel_page_checksums_equal_serial_ones(monkeypatch):
    from hicache_core.storage.page_format import address_of, checksum_runs, pack_header, parallel_checksums

    bufs = [bytearray(os.urandom(4096 + i)) for i in range(9)]
    runs = [[(address_of(b), 1000), (address_of(b) + 1000, len(b) - 1000)] for b in bufs] + [[]]
    want = [checksum_runs(r) for r in runs[:-1]] + [0]
    assert parallel_checksums(runs) == want
    monkeypatch.setenv("HICACHE_L3_HASH_THREADS", "1")
    assert parallel_checksums(runs) == want
    monkeypatch.setenv("HICACHE_L3_HASH_THREADS", "zero")
    with pytest.raises(ValueError, match="HICACHE_L3_HASH_THREADS"):
        parallel_checksums(runs)
    with pytest.raises(ValueError, match="checksum row"):
        pack_header(payload_bytes=1, checksum=0, fingerprint=bytes(16), key_digest=bytes(32), algorithm=2)


def _registered_cases():
    from hicache_core.plugins.registry import get_registry

    reg = get_registry()
    return [(k, lay, v) for k in reg.pool_kinds for lay in reg.layouts for v in ("plain", "sharded", "draft")]


@pytest.mark.parametrize("kind,layout,variant", _registered_cases())
def test_every_registered_kind_layout_and_variant_round_trips_and_catches_a_flip(kind, layout, variant):
    from hicache_core.testing import cases as C

    dp, drafts = C.build_device_pools(kind, variant, 4, DEVICE)
    try:
        host = hc.make_host_pool(dp, layout=layout, io_backend="auto", verify=True, draft_pools=drafts)
    except (hc.UnsupportedCombinationError, ValueError) as exc:
        pytest.skip(f"not served: {str(exc).splitlines()[0]}")
    fill_random(list(C.device_tensors(dp, drafts).values()), seed=9)
    p = host.page_size
    slots, dev = host.alloc(2 * p), torch.arange(p, 3 * p)
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    calls = [(dp, layer, False) for layer in range(dp.start_layer, dp.end_layer)]
    calls += [(d, dp.layer_num + i, True) for i, d in enumerate(drafts)]
    for pool, layer, draft in calls:
        host.load_to_device_per_layer(pool, slots, dev, layer, "auto", is_draft=draft)
    host.check_verified()
    bad = int(slots[p]) // p
    last = host.layer_num - 1  # the last host layer: the draft layer where there is one
    _flip_host_byte(host, bad, layer=last, part=len(host.plan.parts) - 1)
    pool, layer, draft = calls[-1]
    host.load_to_device_per_layer(pool, slots, dev, layer, "auto", is_draft=draft)
    with pytest.raises(PageVerificationError) as info:
        host.check_verified()
    assert info.value.pages == [bad] and info.value.layer_ids == [layer]


def test_the_flat_page_path_reads_pages_with_and_without_a_checksum_row():
    dp, host = _pool("mha", "layer_first")
    slots = host.alloc(8)
    host.backup_from_device_all_layer(dp, slots, torch.arange(4, 12), "auto")
    _sync()
    store = _stored(host, "e")
    store.clear()
    assert store.write_pages(["a"], slots[:4])[0].ok  # with its checksum row
    flat = store.get("a")
    assert flat is not None and torch.equal(flat, host.get_data_page(int(slots[0])))
    assert store.set("b", host.get_data_page(int(slots[4])))  # a flat page: no row
    again = store.get("b")
    assert again is not None and torch.equal(again, host.get_data_page(int(slots[4])))
    got = store.read_pages(["b"], host.alloc(4))[0]  # a verifying pool cannot check a page without its row
    assert got.status is PageStatus.MISMATCH and "bytes" in got.detail  # (zero-copy: the object size differs)


# ---- pages without a checksum, and the default -----------------------------------------------------


def _write_host_pages(host, pages: list[int], seed: int) -> None:
    """Bytes written straight into host pages (as a store or transfer engine writes them through raw pointers)."""
    g = torch.Generator().manual_seed(seed)
    for page in pages:
        for view in host._page_views(page):
            raw = view.view(torch.uint8) if view.dtype != torch.uint8 else view
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def _with_kernel_or_not(host, with_kernel: bool) -> None:
    if with_kernel:
        if os.environ.get("TRITON_INTERPRET") != "1" or DEVICE != "cpu":
            pytest.skip("the kernel on CPU pools: under TRITON_INTERPRET=1")
        host.verifier = host.verification.make_verifier(kernel=True)


@pytest.mark.parametrize("with_kernel", [False, True])
def test_a_page_written_by_other_means_is_checksummed_by_its_first_load_then_checked(with_kernel):
    dp, host = _pool("mha", "page_first")
    _with_kernel_or_not(host, with_kernel)
    p = host.page_size
    slots = host.alloc(2 * p)
    dev = torch.arange(p, 3 * p)
    pages = [int(s) // p for s in slots[::p]]
    _write_host_pages(host, pages, seed=11)  # never backed up: no checksum yet
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, slots, dev, layer, "auto")
    host.check_verified()  # nothing to check against: the load took the checksums, and reports nothing
    want = checksum_rows(dp.k_buffer[1][dev].cpu(), 1, 0, p)
    assert torch.equal(host.verifier.table[pages, 1, 0], want)  # ... of the bytes it loaded
    _flip_host_byte(host, pages[1], layer=2)
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, slots, dev, layer, "auto")
    with pytest.raises(PageVerificationError) as info:  # from then on, a flipped bit is caught
        host.check_verified()
    assert info.value.pages == [pages[1]] and info.value.layer_ids == [2]


def test_pages_handed_out_as_raw_pointers_or_freed_drop_their_checksums_and_no_others():
    dp, host = _pool("mha", "page_first_direct")
    p = host.page_size
    slots = host.alloc(3 * p)
    dev = torch.arange(p, 4 * p)
    pages = [int(s) // p for s in slots[::p]]
    host.backup_from_device_all_layer(dp, slots, dev, "auto")
    _sync()
    ptrs, sizes = host.get_page_buffer_meta(slots[: 2 * p])  # a store will write pages 0 and 1 through these
    assert len(ptrs) == len(sizes) > 0
    assert host.verifier.unchecked_pages_total == 2
    _write_host_pages(host, pages[:2], seed=12)  # ... and does: other bytes than the backup's
    _flip_host_byte(host, pages[2], layer=0)  # page 2 was not handed out: its bytes must still match
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, slots, dev, layer, "auto")
    with pytest.raises(PageVerificationError) as info:
        host.check_verified()
    assert info.value.pages == [pages[2]]  # not pages 0 and 1: their bytes came by other means
    host.free(slots)
    assert bool((host.verifier.table[pages] == NO_CHECKSUM).all())  # the freed pages' checksums went with them
    assert host.alloc(host.available_size()) is not None  # taken again (every page of the pool) ...
    _write_host_pages(host, pages, seed=13)  # ... and written by other means
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, slots, dev, layer, "auto")
    host.check_verified()


def test_the_default_is_on_for_cuda_pools_that_can_be_verified_and_off_for_cpu_pools(monkeypatch):
    monkeypatch.delenv("HICACHE_VERIFY", raising=False)
    dp = device_pool("mha", 4, pages=6)
    host = hc.make_host_pool(dp, layout="page_first", io_backend="auto")
    if DEVICE == "cpu":
        assert host.verifier is None and not host.verify
        assert host.verify_reason.startswith("off: a CPU pool (on by default on CUDA")
    else:
        assert host.verifier is not None and host.verify_reason == "on: the default for a CUDA pool"
        odd = hc.MHADevicePool(64, 4, torch.float8_e4m3fn, 1, 6, 2, DEVICE)  # 6-byte rows: not whole words
        unverifiable = hc.make_host_pool(odd, layout="page_first", io_backend="auto")
        assert unverifiable.verifier is None and unverifiable.verify_reason.startswith("off: ")
        assert "a device row of 6 bytes is not a whole number of 32-bit words" in unverifiable.verify_reason
        with pytest.raises(ValueError, match="not a whole number of 32-bit words"):  # asked for: refused, as ever
            hc.make_host_pool(odd, layout="page_first", io_backend="auto", verify=True)
        host.get_contiguous_buf_infos()  # the whole memory handed out: the default stops, saying why (a warning)
        assert host.verifier is None and host.verify_reason.startswith("off: get_contiguous_buf_infos handed")
        partial = hc.make_host_pool(dp, layout="page_first", io_backend="auto")
        partial.load_to_device_per_layer(dp, partial.alloc(4)[:3], torch.arange(4, 7, device=DEVICE), 0, "auto")
        assert partial.verifier is None and partial.verify_reason.startswith("off: a call moved 3 slots, part of")
    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv("HICACHE_VERIFY", value)
        pool = hc.make_host_pool(dp, layout="page_first", io_backend="auto")
        assert pool.verify is on and pool.verify_reason == f"{'on' if on else 'off'}: HICACHE_VERIFY={value}"
    assert hc.make_host_pool(dp, layout="page_first", io_backend="auto", verify=True).verify_reason == "on: verify=True"
    monkeypatch.setenv("HICACHE_VERIFY", "1")
    asked = hc.make_host_pool(dp, layout="page_first", io_backend="auto")
    with pytest.raises(ValueError, match=r"verifies its pages \(HICACHE_VERIFY=1\), but get_contiguous_buf_infos"):
        asked.get_contiguous_buf_infos()  # asked for: the pool refuses rather than stop
    assert asked.verify


def test_a_destroyed_pool_lets_its_verifier_and_its_pinned_table_go():
    # The pool's events call the verifier's own methods while it verifies; destroy must drop them with it, or
    # the checksum table stays allocated (and, on CUDA, pinned and counted) after the pool is gone.
    import gc
    import weakref

    dp, host = _pool("mha", "page_first")
    verifier = weakref.ref(host.verifier)
    table = weakref.ref(host.verifier.table)
    assert host.verifier.check in host._on.after_load  # the pool calls the verifier directly
    host.destroy()
    gc.collect()
    assert verifier() is None and table() is None
    assert host.verification.__dict__.keys().isdisjoint({"before_call", "after_load"})


@pytest.mark.parametrize("kind,layout", [*CASES, ("mha", "page_head")])
def test_a_stored_pages_checksum_row_is_taken_from_its_bytes_as_the_device_takes_it(kind, layout, tmp_path,
                                                                                       monkeypatch):  # fmt: skip
    """A GPU server's default store (verifying pool, no cluster key) writes device-checked pages: their payload is
    checked only by the load to the device. ``check_page`` (``explain-miss``) takes that check on the host: the
    row it takes from a stored page's bytes is the row the backup took from the device rows, and a payload byte
    flipped in the store makes the page ``corrupt`` before any load."""
    monkeypatch.delenv("HICACHE_L3_KEY", raising=False)
    monkeypatch.delenv("HICACHE_L3_KEY_FILE", raising=False)
    dp, host = _pool(kind, layout)
    p = host.page_size
    slots = host.alloc(2 * p)
    host.backup_from_device_all_layer(dp, slots, torch.arange(p, 3 * p), "auto")
    host.check_verified()
    store = make_storage(f"file://{tmp_path}", host, model_id="rows")
    assert store.device_checked
    pages = [int(slots[0]) // p, int(slots[p]) // p]
    for page in pages:  # the oracle: the verifier's own table, taken from the device rows at backup
        runs = store.pages.page_spans(page)
        payload = torch.cat([torch.frombuffer(bytearray(s.view), dtype=torch.uint8) for s in runs])
        assert torch.equal(store.pages.checksum_row_of(payload), host.verification.table[page])
    keys = [f"{i + 1:064x}" for i in range(2)]
    assert all(r.ok for r in store.write_pages(keys, slots))
    assert [store.check_page(k).status for k in keys] == [PageStatus.OK, PageStatus.OK]
    path = store.backend.path_of(store.namespace.key(keys[1]))
    data = bytearray(path.read_bytes())
    at = len(data) - store.pages.trailer_bytes - 5  # a payload byte, before the checksum row
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    result = store.check_page(keys[1])
    assert result.status is PageStatus.CORRUPT and "checksum row" in result.detail, result
    assert store.check_page(keys[0]).ok
    store.close()
