"""DeepSeek-V4 HiSparse C4 host transfers: hicache's word-granular pool against SGLang's own copy (CUDA only).

Both pools mirror the same device C4 buffers (SGLang's ``(pages, 37440)`` uint8 rows). Timed, per
call, after warm-up: the decode step's token backup (``backup_tokens_from_device_all_layer``, one
token per request), prefill staging of whole pages (``backup_from_device_all_layer``) and the
per-layer token preload (``load_to_device_per_layer``). Prints one JSON object.

Run on the GPU machine after ``integrations/sglang/dev gpu ...`` has installed the wheels:
``PYTHONPATH=/tmp/hicache-sglang-site python3 benchmarks/hisparse_dsv4_c4.py [--layers 4] [--pages 512]``
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pages", type=int, default=512, help="device and host C4 pages")
    parser.add_argument("--reqs", type=int, default=64, help="tokens per decode backup (one per request)")
    parser.add_argument("--stage-pages", type=int, default=32, help="whole pages per staging backup")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hisparse_dsv4_c4.py needs CUDA: SGLang's token-granular C4 copy is a CUDA kernel")
    os.environ.setdefault("HICACHE_SGLANG_HISPARSE_SWAP_IN", "sglang")
    from hicache_sglang.builders.hisparse_dsv4 import SGLangHiSparseDSV4HostPool, c4_page_bytes
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    row = c4_page_bytes()
    device = [torch.randint(0, 256, (args.pages, row), dtype=torch.uint8, device="cuda") for _ in range(args.layers)]
    dev_pool = type("C4", (), {"kv_buffer": device})()
    kw = dict(pool_name="dsv4_hisparse_c4", device_buffers=device, item_bytes=row, num_host_pages=args.pages,
              slot_page_size=64, layout="layer_first")  # fmt: skip
    pools = {"hicache": SGLangHiSparseDSV4HostPool(**kw), "sglang": DeepSeekV4PagedHostPool(**kw)}
    g = torch.Generator().manual_seed(0)
    tok_h = torch.randperm(args.pages * 64, generator=g)[: args.reqs].cuda()
    tok_d = torch.randperm(args.pages * 64, generator=g)[: args.reqs].cuda()
    pg_h = torch.arange(args.stage_pages * 64, device="cuda")
    pg_d = torch.arange(args.stage_pages * 64, device="cuda") + 64
    out = {"device": torch.cuda.get_device_name(), "layers": args.layers, "reqs": args.reqs,
           "stage_pages": args.stage_pages, "us_per_call": {}}  # fmt: skip
    original = [t.clone() for t in device]
    for name, pool in pools.items():
        for t, o in zip(device, original):  # each pool starts from the same device bytes (loads write them)
            t.copy_(o)
        calls = {
            "decode_token_backup": lambda p=pool: p.backup_tokens_from_device_all_layer(tok_h, tok_d),
            "staging_page_backup": lambda p=pool: p.backup_from_device_all_layer(dev_pool, pg_h, pg_d, "kernel"),
            "token_load_one_layer": lambda p=pool: p.load_to_device_per_layer(dev_pool, tok_h, tok_d, 0, "kernel"),
        }
        out["us_per_call"][name] = {what: _time(fn, args.iters) for what, fn in calls.items()}
    ours, theirs = pools["hicache"], pools["sglang"]
    out["host_bytes_equal"] = all(torch.equal(a, b) for a, b in zip(ours.kv_buffer, theirs.kv_buffer))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
