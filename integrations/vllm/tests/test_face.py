"""hicache_vllm's public face is hicache_core.lazy's: names resolve on first use, are cached, and are listed."""

from __future__ import annotations

import hicache_vllm
import pytest


def test_the_face_resolves_and_caches_what_imports_without_vllm():
    for name in ("BlockMover", "VllmPagePool", "VLLM_PAGE", "NotServedError", "SERVED_VLLM_VERSIONS"):
        value = getattr(hicache_vllm, name)
        assert vars(hicache_vllm)[name] is value
    listing = dir(hicache_vllm)
    assert set(hicache_vllm.__all__) <= set(listing) and len(listing) == len(set(listing))
    with pytest.raises(AttributeError, match=r"^module 'hicache_vllm' has no attribute 'nope'$"):
        hicache_vllm.nope  # noqa: B018
