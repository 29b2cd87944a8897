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


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cpu_bytes_to_use": None}, "cpu_bytes_to_use must be given"),
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
