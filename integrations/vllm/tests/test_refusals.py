"""What hicache-vllm refuses, and that each refusal names what would work (no vLLM engine needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hicache_vllm.config import parse_extra_config
from hicache_vllm.errors import NotServedError
from hicache_vllm.mover import BlockMover
from hicache_vllm.pool_kind import VllmPagePool
from hicache_vllm.version import check_vllm_version

from hicache_core import UnsupportedCombinationError

BASE = {"spec_module_path": "hicache_vllm", "spec_name": "HicacheOffloadingSpec", "cpu_bytes_to_use": 1 << 20}


def test_another_vllm_version_is_refused_naming_the_served_one():
    with pytest.raises(NotServedError, match=r"serves vLLM 0\.32\.0; this is vLLM 0\.31\.1"):
        check_vllm_version("0.31.1")
    assert check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"


def test_the_spec_refuses_an_installed_vllm_of_another_version():
    pytest.importorskip("vllm", reason="needs vLLM installed (integrations/vllm/dev's environment)")
    code = ("import vllm; vllm.__version__ = '0.33.0'\n"
            "import hicache_vllm\n"
            "try:\n    hicache_vllm.HicacheOffloadingSpec\n"
            "except hicache_vllm.NotServedError as e:\n    print(e)\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "serves vLLM 0.32.0; this is vLLM 0.33.0" in out.stdout


def test_vllm_cpu_spec_keys_are_accepted_and_hicache_keys_read():
    opts = parse_extra_config({**BASE, "eviction_policy": "arc", "store_threshold": 2, "max_tracker_size": 10,
                               "offload_prompt_only": False, "block_size": 64, "hicache_layout": "layer_first",
                               "hicache_io_backend": "direct"})  # fmt: skip
    assert (opts.layout, opts.io_backend, opts.storage_url) == ("layer_first", "direct", None)
    opts = parse_extra_config({**BASE, "hicache_storage_url": "file:///tmp/x", "hicache_storage_options": {"fsync": 1}})
    assert opts.storage_url == "file:///tmp/x" and opts.storage_options == {"fsync": 1}


GIB = 1 << 30
SPEC = {"spec_name": "HicacheOffloadingSpec"}


@pytest.mark.parametrize(
    ("extra", "size"),
    [
        ({"kv_offloading_size": 8}, 8 * GIB),  # the one-line config: GiB, as vLLM's flag reads it
        ({"kv_offloading_size": "0.5"}, GIB // 2),
        ({"cpu_bytes_to_use": 0.0625 * GIB}, 64 << 20),  # what vLLM's --kv-offloading-size 0.0625 hands the spec
        ({"cpu_bytes_to_use": "8000000000"}, 8_000_000_000),  # vLLM's CPU spec takes int() of a string too
        ({"kv_offloading_size": 1.5, "cpu_bytes_to_use": 1.5 * GIB}, 3 * GIB // 2),  # the flag and the key agree
    ],
)
def test_the_host_tiers_size_in_gib_or_bytes(extra, size):
    assert parse_extra_config({**SPEC, **extra}).host_bytes == size


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, r"the host tier's size must be given: vLLM's --kv-offloading-size GIB"),
        ({"cpu_bytes_to_use": None}, "size must be given"),
        ({"kv_offloading_size": 8, "cpu_bytes_to_use": 8_000_000_000},
         r"kv_offloading_size 8 GiB is 8589934592 bytes, but cpu_bytes_to_use is 8000000000: give one of them"),
        ({"kv_offloading_size": 0}, r"kv_offloading_size must be a positive number of GiB, got 0"),
        ({"kv_offloading_size": -2}, "must be a positive number of GiB"),
        ({"kv_offloading_size": float("nan")}, r"must be a positive number of GiB, got nan"),
        ({"kv_offloading_size": "inf"}, "must be a positive number of GiB"),
        ({"kv_offloading_size": True}, r"kv_offloading_size must be a number of GiB, got True"),
        ({"kv_offloading_size": "8G"}, "must be a number of GiB"),
        ({"kv_offloading_size": 1e-12}, "kv_offloading_size 1e-12 is less than a byte"),
        ({"cpu_bytes_to_use": 0}, r"cpu_bytes_to_use must be a positive number of bytes, got 0"),
        ({"cpu_bytes_to_use": float("inf")}, "must be a positive number of bytes"),
        ({"cpu_bytes_to_use": [1]}, "must be a number of bytes"),
    ],
)  # fmt: skip
def test_a_bad_or_ambiguous_size_is_refused(extra, message):
    with pytest.raises(NotServedError, match=message):
        parse_extra_config({**SPEC, **extra})


def test_vllm_finds_the_spec_by_name_through_the_general_plugin():
    """``"spec_name": "HicacheOffloadingSpec"`` alone: the plugin registered the name in vLLM's factory."""
    pytest.importorskip("vllm", reason="needs vLLM installed (integrations/vllm/dev's environment)")
    code = ("from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "from hicache_vllm._vllm_plugin import register\n"
            "register()  # a second call changes nothing\n"
            "from vllm.v1.kv_offload.factory import OffloadingSpecFactory\n"
            "cls = OffloadingSpecFactory.get_spec_cls({'spec_name': 'HicacheOffloadingSpec'})\n"
            "print(cls.__module__, cls.__name__)\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["hicache_vllm.spec", "HicacheOffloadingSpec"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cpu_bytes_to_use": "lots"}, "must be a number of bytes"),
        ({"secondary_tiers": []}, "with hicache, L3 is hicache_storage_url"),
        ({"hicache_layuot": "page_first"}, "does not know: hicache_layuot"),
        ({"canonical_layout": True}, "canonical_layout is not served"),
        ({"hicache_storage_url": "/tmp/dir"}, "must be a URL"),
        ({"hicache_storage_url": "file:///tmp/x", "store_threshold": 2}, "store_threshold >= 2"),
        ({"hicache_storage_options": {"a": 1}}, "without hicache_storage_url"),
        ({"hicache_io_backend": ""}, "non-empty string"),
    ],
)
def test_bad_extra_config_is_refused(extra, message):
    with pytest.raises(NotServedError, match=message):
        parse_extra_config({**BASE, **extra})


def pages(n: int = 2, rows: int = 4, width: int = 64) -> list[torch.Tensor]:
    return [torch.zeros(rows, width, dtype=torch.int8) for _ in range(n)]


def test_pages_vllm_does_not_give_uniformly_are_refused():
    with pytest.raises(NotServedError, match="one page size"):
        VllmPagePool([torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 32, dtype=torch.int8)], 32)
    with pytest.raises(NotServedError, match="packed cross-layer"):
        VllmPagePool([torch.zeros(4, 128, dtype=torch.int8)[:, :64]], 32)
    with pytest.raises(NotServedError, match="2-D int8"):
        VllmPagePool([torch.zeros(4, 64, dtype=torch.float16)], 32)
    with pytest.raises(NotServedError, match="no KV cache layers"):
        VllmPagePool([], 32)


def test_layout_or_io_backend_no_plugin_serves_is_refused_by_the_dispatcher():
    with pytest.raises(UnsupportedCombinationError, match="page_head"):
        BlockMover(pages(), block_size=32, num_chunks=2, layout="page_head")
    with pytest.raises(UnsupportedCombinationError, match="nope"):
        BlockMover(pages(), block_size=32, num_chunks=2, io_backend="nope")
    with pytest.raises(NotServedError, match="one device block per offloaded chunk"):
        BlockMover(pages(), block_size=32, num_chunks=2, blocks_per_chunk=2, storage_url="memory://x", model_id="m")
    m = BlockMover(pages(), block_size=32, num_chunks=2)
    assert m.host.implementations  # resolved once, at construction
    m.submit_store(1, np.array([0]), np.array([1]))
    with pytest.raises(ValueError, match="already in flight"):
        m.submit_store(1, np.array([1]), np.array([0]))
    m.shutdown()
