"""L3 through SGLang's ``file`` storage backend (HiCacheFile), on hicache host pools.

A producer tree writes a sequence to the files (the kit's ``_l3_produce`` path: backup to
host, ``write_backup_storage``, SGLang's backup thread calling ``get_data_page``); each
file must hold that page's device bytes in SGLang's flat-page order, so pages written by
hicache and by SGLang's own host pools are interchangeable. A fresh consumer tree then
prefetches the sequence from the files (``prefetch_from_storage``, SGLang's prefetch
threads calling ``set_from_flat_data_page``) and loads it to its device: same bytes.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

import pytest
import torch
from radix_kit import kit_pointed_at, make_case
from sglang_setup import (
    KIND_PAIR_IDS,
    KIND_PAIRS,
    LAYERS,
    PP_START,
    device_layers,
    device_rows,
    fill_random,
    flat_page,
)

CASES, CASE_IDS = KIND_PAIRS, KIND_PAIR_IDS


@pytest.mark.parametrize("start_layer", [0, PP_START], ids=["rank0", "pp-start20"])
@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
@pytest.mark.parametrize("kind, layout, io_backend", CASES, ids=CASE_IDS)
def test_write_to_files_and_read_back(kind, layout, io_backend, page_size, start_layer):
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix

    case = make_case(page_size)
    storage_dir = tempfile.mkdtemp(prefix="hicache-sglang-l3-")
    case.addCleanup(shutil.rmtree, storage_dir, ignore_errors=True)
    try:
        with kit_pointed_at(kind, layout, io_backend, start_layer):
            seq = case._make_seq(1, max(3, 24 // page_size))
            producer, prod_alloc, prod_rtp = build_fixture(case.cfg)
            case._init_hicache(producer, storage_backend="file", storage_dir=storage_dir, prefetch_threshold=1)
            assert producer.cache_controller.storage_backend_type == "file"
            case._insert(producer, prod_alloc, prod_rtp, seq)
            leaf = match_prefix(producer, seq).last_device_node
            slots = producer.path_device_indices(leaf)
            dev = prod_alloc.get_kvcache()
            fill_random(device_layers(dev), seed=31)
            written = [device_rows(dev, kind, layer, slots) for layer in range(LAYERS)]
            case._backup_node(producer, leaf)
            case._write_path_to_l3(producer, leaf)
            case._flush_l3_backups(producer)

            hashes = case._all_page_hashes(producer, leaf)
            assert len(hashes) == len(seq) // page_size
            kv_lora_bytes = 32 * dev.kv_buffer[0].element_size() if kind == "mla" else 0
            for page, key in enumerate(hashes):
                files = glob.glob(os.path.join(storage_dir, f"{key}*.bin"))
                assert len(files) == 1, (key, sorted(os.listdir(storage_dir)))
                with open(files[0], "rb") as f:
                    stored = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
                page_slots = slots[page * page_size : (page + 1) * page_size]
                assert torch.equal(stored, flat_page(kind, layout, dev, page_slots, kv_lora_bytes)), f"page {page}"

            consumer, cons_alloc, _ = case._l3_consumer(storage_dir)
            case._consume_prefetch(consumer, seq, CacheRequestHandle("read-back", 0))
        match = match_prefix(consumer, seq)
        assert (match.device_prefix_len, match.host_hit_length) == (0, len(seq))
        loaded = case._load_back_node(consumer, match.last_host_node)
        cons_dev = cons_alloc.get_kvcache()
        for layer in range(LAYERS):
            assert all(torch.equal(a, b) for a, b in zip(device_rows(cons_dev, kind, layer, loaded), written[layer]))
    finally:
        case.doCleanups()
