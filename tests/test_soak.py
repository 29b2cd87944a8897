"""The GPU gate's soak (scripts/gpu/soak.py), run small on CPU pools: its loop works, and it catches a bad copy."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("hicache_soak", ROOT / "scripts" / "gpu" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


SMALL = ["--device", "cpu", "--kinds", "mha", "--backends", "direct", "--layers", "2", "--page-size", "4",
         "--device-tokens", "32", "--round-tokens", "32", "--bytes", "4M"]  # fmt: skip


def test_sizes_read_as_written(soak):
    assert soak.parse_bytes("1TB") == 10**12 and soak.parse_bytes("1TiB") == soak.parse_bytes("1T") == 1 << 40
    assert soak.parse_bytes("4M") == 4 << 20 and soak.parse_bytes("64MB") == 64 * 10**6


def test_content_is_a_function_of_the_tag_alone(soak):
    a = soak.content(torch.tensor([3, 4]), 4, 8, layer=1, comp=0)
    assert a.shape == (8, 8) and a.dtype == torch.int32
    assert torch.equal(a[4:], soak.content(torch.tensor([4]), 4, 8, layer=1, comp=0))
    assert not torch.equal(a, soak.content(torch.tensor([3, 4]), 4, 8, layer=2, comp=0))
    assert not torch.equal(a, soak.content(torch.tensor([3, 4]), 4, 8, layer=1, comp=1))
    assert len(set(a.reshape(-1).tolist())) > 60  # not a constant pattern a copy could get right by chance


def test_the_soak_moves_its_bytes_evicts_and_reuses_slots_and_finds_nothing(soak, tmp_path):
    out = tmp_path / "soak.json"
    assert soak.main([*SMALL, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["result"] == "ok" and summary["combinations"] == 2  # layer_first and page_first_direct
    assert summary["bytes_moved"] >= 2 << 20 and summary["mismatched_pages"] == 0
    assert summary["evicted_pages"] > 0 and summary["pages_loaded"] > 0
    assert summary["verification_failures"] == 0 and not summary["errors"]


def test_a_copy_that_flips_a_byte_is_found(soak, tmp_path, monkeypatch):
    """A planted bug in the copy path (one byte of each loaded layer flipped after the copy, where
    verification cannot see it) makes the soak fail with mismatched pages."""
    from hicache_core.pool.host_pool import HostPool

    real = HostPool.load_to_device_per_layer

    def flipping(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw):
        real(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw)
        device_pool.k_buffer[layer_id].view(torch.uint8).reshape(device_pool.size, -1)[device_indices[0], 5] ^= 1

    monkeypatch.setattr(HostPool, "load_to_device_per_layer", flipping)
    out = tmp_path / "soak.json"
    assert soak.main([*SMALL, "--out", str(out)]) == 1
    summary = json.loads(out.read_text())
    assert summary["result"] == "failed" and summary["mismatched_pages"] > 0
