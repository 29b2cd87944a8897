"""TEST ONLY: the end-to-end suite's negative control, on its servers' PYTHONPATH only (never installed).

With ``HICACHE_E2E_CORRUPT_FLAG=<path>`` in a server's environment, every host -> device
load through the adapter flips the sign bit of every element it loaded into the device
pool while the file ``<path>`` exists. The suite creates the file, sends a prefix that
comes back from the host tier, and requires the outputs to change: so the equality the
suite checks really depends on the bytes that came back. Without the variable this
module does nothing.
"""

import os

_FLAG = os.environ.get("HICACHE_E2E_CORRUPT_FLAG")

if _FLAG:
    import torch

    def _flip(tensor, rows):
        # Little-endian: the last byte of each element holds its sign bit.
        raw = tensor[rows].view(torch.uint8).reshape(len(rows), -1, tensor.element_size())
        raw[..., -1] ^= 0x80
        tensor[rows] = raw.reshape(len(rows), -1).view(tensor.dtype).reshape(tensor[rows].shape)

    def _install():
        from hicache_sglang import pool

        load = pool.SGLangHostPool.load_to_device_per_layer

        def corrupting_load(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw):
            load(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw)
            if not os.path.exists(_FLAG) or kw.get("is_draft"):
                return
            rows = device_indices.to("cpu", torch.int64)
            buffers = (
                [device_pool.kv_buffer[layer_id]]
                if hasattr(device_pool, "kv_buffer")
                else [device_pool.k_buffer[layer_id], device_pool.v_buffer[layer_id]]
            )
            for buf in buffers:
                _flip(buf, rows.to(buf.device))

        pool.SGLangHostPool.load_to_device_per_layer = corrupting_load

    _install()
