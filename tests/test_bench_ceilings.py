"""The SM-copy ceiling's kernel moves every byte, each way (under Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from hicache_core.testing.guarded import triton_test_device


@pytest.mark.parametrize("to_device", [True, False])
@pytest.mark.parametrize("shape", [(8, 4, 2048), ("1sm", 8, 8192), ("4sm", 4, 2048)])
def test_stream_copy_moves_every_word(to_device, shape):
    from hicache_core.tools.bench.ceilings import SMCopy

    device = triton_test_device()
    copy = SMCopy(16384 * 8 * 3, device=device)
    gen = torch.Generator().manual_seed(1)
    src, dst = (copy.host, copy.dev) if to_device else (copy.dev, copy.host)
    src.copy_(torch.randint(-(2**62), 2**62, src.shape, generator=gen))
    dst.fill_(0)
    copy.call(to_device, shape)()
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src.cpu())


def test_sizes_that_no_launch_shape_divides_are_refused():
    from hicache_core.tools.bench.ceilings import SMCopy

    with pytest.raises(ValueError, match="nbytes must be a multiple of 131072, got 1000"):
        SMCopy(1000, device="cpu")
