"""The page-checksum kernel alone: the time a load's check adds per layer, beside the layer's copy at the link.

Run on the GPU machine::

    python benchmarks/checksum_kernel.py --out $OUT/checksum-kernel-h200.json

For a llama-8b-like MHA pool (K and V rows of 2048 B) and an MLA pool (1152 B rows), page 64, at
4096 and 32768 tokens: the GPU time of a load's checks per layer (kernels queued behind a sleeping
one, so host time is not measured), median of ``--repeats``, in four variants:

* ``retired``: the kernel as it was before 0.4 (a program per group of 8 rows, two 64-bit multiplies
  per word, the table read last), one launch per layer;
* ``per_layer``: the kernel hicache runs (``hicache_core.gpu.page_checksum_kernel``), one launch per
  layer (a synchronous per-layer load's check);
* ``per_layer_device_table``: the same, reading a copy of the table in device memory, which shows
  what the table's round trip over the link costs;
* ``one_launch``: every layer in one launch (a layer-wise load's check, ``CheckBatch``).

Beside each: one layer's bytes copied host -> device by the copy engine (``cudaMemcpyAsync``, one
pinned buffer), the ceiling of the load the check follows, in the same run.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from verify_cost import write_result  # beside this file

import hicache_core as hc
from hicache_core.verification.page_checksum import M2

_M2 = tl.constexpr(M2)


@triton.jit(do_not_specialize=("entries", "hidx", "didx", "seq"))
def _retired(anchor, entries, hidx, didx, table, fail_word, fail_pages, seq, host_pages, table_columns,
             TOKENS: tl.constexpr, GROUP: tl.constexpr, BLOCK_W: tl.constexpr, CHECK: tl.constexpr):  # fmt: skip
    # The kernel before 0.4, kept here only to measure against.
    page = tl.program_id(0).to(tl.int64)
    entry = (anchor + entries).to(tl.pointer_type(tl.int64)) + tl.program_id(1) * 6
    group = tl.program_id(2)
    layer_off = tl.load(entry)
    row_stride = tl.load(entry + 1)
    words = tl.load(entry + 2)
    s = tl.load(entry + 3)
    column = tl.load(entry + 4)
    rows = tl.load(entry + 5)
    hp = tl.load((anchor + hidx).to(tl.pointer_type(tl.int64)) + page * TOKENS) // TOKENS
    t = group * GROUP + tl.arange(0, GROUP)
    live_t = t < TOKENS
    r = tl.load((anchor + didx).to(tl.pointer_type(tl.int64)) + page * TOKENS + t, mask=live_t, other=-1)
    ok_t = live_t & (r >= 0) & (r < rows)
    base = (anchor + layer_off + r * row_stride).to(tl.pointer_type(tl.int32))
    lanes = tl.arange(0, BLOCK_W)
    acc = tl.zeros((GROUP, BLOCK_W), dtype=tl.int64)
    w0 = 0
    while w0 < words:
        w = w0 + lanes
        mask = ok_t[:, None] & (w < words)[None, :]
        vals = tl.load(base[:, None] + w[None, :], mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
        pos = t.to(tl.int64)[:, None] * words + w[None, :]
        acc += vals * (s + pos * _M2)
        w0 += BLOCK_W
    total = tl.sum(tl.sum(acc, axis=1), axis=0)
    slot = (anchor + table).to(tl.pointer_type(tl.int64)) + hp * table_columns + column + group
    live = (hp >= 0) & (hp < host_pages)
    if CHECK:
        expected = tl.load(slot, mask=live, other=0)
        bad = live & (expected != total)
        tl.store((anchor + fail_word).to(tl.pointer_type(tl.int64)), seq, mask=bad)
        tl.store((anchor + fail_pages).to(tl.pointer_type(tl.int64)) + hp, seq, mask=bad)
    else:
        tl.store(slot, total, mask=live)


def _gpu_ms(fn, repeats: int) -> float:
    """Median GPU time of ``fn``'s launches, queued behind a sleeping kernel so that host time is not measured."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(20_000_000)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def _case(kind: str, tokens: int, page: int, repeats: int) -> dict:
    size = tokens + 4 * page
    if kind == "mha":
        dp = hc.MHADevicePool(size, page, torch.bfloat16, 8, 128, 32, "cuda")
        bufs = dp.k_buffer + dp.v_buffer
    else:
        dp = hc.MLADevicePool(size, page, torch.bfloat16, 512, 64, 61, "cuda")
        bufs = dp.kv_buffer
    for t in bufs:
        t.copy_(torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16, device="cuda").view(t.dtype))
    host = hc.make_host_pool(dp, layout="page_first", io_backend="kernel", verify=True, size=2 * size)
    slots = host.alloc(tokens).cuda()
    dev = torch.arange(page, page + tokens, device="cuda")
    host.backup_from_device_all_layer(dp, slots, dev, "kernel")
    torch.cuda.synchronize()
    v = host.verifier
    layers = dp.layer_num
    h, d = v._move(slots, v.device), v._move(dev, v.device)
    device_table = v.table.to("cuda")
    host_table_off = v._table_off
    every = list(range(layers))
    base = v._base

    def per_layer() -> None:
        for layer in every:
            v._launch(h, d, layer, 1, True)

    def one_launch() -> None:
        v._launch(h, d, every, -1, True, seq_step=len(v.components))

    def retired() -> None:
        block_w = min(1024, 1 << max(4, (max(v.words) - 1).bit_length()))
        group = min(8, 1 << (v.tokens - 1).bit_length())
        for layer in every:
            entries = v._entries_layer[layer]
            _retired[(h.numel() // v.tokens, entries.shape[0], v.groups)](
                v._anchor, entries.data_ptr() - base, h.data_ptr() - base, d.data_ptr() - base, v._table_off,
                v._flag_off, v._failed_off, 1, v.num_pages, v.columns, TOKENS=v.tokens, GROUP=group,
                BLOCK_W=block_w, CHECK=True, num_warps=4,
            )  # fmt: skip

    row = {"pool": kind, "tokens": tokens, "page": page, "layers": layers, "layer_bytes": host.get_size_per_token()
           * tokens // layers, "tile": list(v._tile)}  # fmt: skip
    variants = {"retired": (retired, host_table_off), "per_layer": (per_layer, host_table_off),
                "per_layer_device_table": (per_layer, device_table.data_ptr() - base),
                "one_launch": (one_launch, host_table_off)}  # fmt: skip
    for name, (fn, table_off) in variants.items():
        v._table_off = table_off
        try:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            row[f"check_us_per_layer_{name}"] = _gpu_ms(fn, repeats) * 1000 / layers
        finally:
            v._table_off = host_table_off
    host.check_verified()  # every check above was clean: nothing may be reported
    nbytes = row["layer_bytes"]
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dbuf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    row["copy_us_per_layer_ceiling"] = _gpu_ms(lambda: dbuf.copy_(pinned, non_blocking=True), repeats) * 1000
    for name in variants:
        row[f"check_of_copy_{name}"] = row[f"check_us_per_layer_{name}"] / row["copy_us_per_layer_ceiling"]
        row[f"hbm_tbps_{name}"] = nbytes / row[f"check_us_per_layer_{name}"] / 1e6
    host.destroy()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("checksum_kernel.py measures the GPU: run it on the GPU machine")
    rows = []
    for kind in ("mha", "mla"):
        for tokens in (4096, 32768):
            r = _case(kind, tokens, 64, args.repeats)
            rows.append(r)
            print(f"{kind} {tokens:6}: copy {r['copy_us_per_layer_ceiling']:8.1f} us/layer; check (us/layer) "
                  + ", ".join(f"{k[len('check_us_per_layer_'):]} {v:.1f}" for k, v in r.items()
                              if k.startswith("check_us_per_layer_")))  # fmt: skip
    write_result(args.out, "the load check's kernel per layer beside the layer's copy-engine copy (the ceiling), "
                 "same run", rows)  # fmt: skip

if __name__ == "__main__":
    main()
