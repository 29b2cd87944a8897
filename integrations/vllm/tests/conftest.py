"""hicache-vllm's tests. Device tensors live on ``HICACHE_TEST_DEVICE`` (``cpu`` by default; ``cuda`` on
the GPU machine, which has no vLLM: the block mover's tests need none, the engine tests skip there)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).parent))
