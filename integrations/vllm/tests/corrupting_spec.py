"""The negative control (tests only, never installed): a spec whose loads land random bytes.

If the engine's outputs did not depend on the bytes hicache loads, the equal-output tests would
prove nothing; with this spec (same manager, same mover) the outputs must change.
"""

from __future__ import annotations

import numpy as np
import torch
from hicache_vllm.spec import HicacheOffloadingSpec, HicacheOffloadingWorker


class _CorruptingWorker(HicacheOffloadingWorker):
    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        ok = super().submit_load(job_id, src_spec, dst_spec)
        self.mover.wait({job_id})
        blocks = torch.from_numpy(np.asarray(dst_spec.block_ids, dtype=np.int64))
        g = torch.Generator().manual_seed(job_id)
        with torch.inference_mode(False):
            for pages in self.mover.device_pool.vllm_kv_pages:
                noise = torch.randint(0, 256, (len(blocks), pages.shape[1]), generator=g, dtype=torch.uint8)
                pages.index_copy_(0, blocks, noise.to(pages.device))
        return ok


class CorruptingOffloadingSpec(HicacheOffloadingSpec):
    def get_worker(self, kv_caches):
        if self._worker is None:
            worker = super().get_worker(kv_caches)
            self._worker = _CorruptingWorker(worker.mover)
        return self._worker
