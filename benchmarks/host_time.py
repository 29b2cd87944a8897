"""Host time per 64-token load (the bar: <= 8 us per call), and the floors beneath it.

    python benchmarks/host_time.py --label new --out host-time.json

For jit.one_layer and kernel.triton_uva on MLA and llama-8b pools (page_first and layer_first,
page size 64, 8 CTAs): a call through the host pool (what a server pays) and a call to the
implementation; beside them the floors: Triton's C launcher on an empty kernel, a torch ``add_``,
and, where it imports, SGLang's function for the same load (``HICACHE_BENCH_ANCHOR``). Each figure
is the median of 5 batches of 1000 calls (hicache_core.tools.bench.clock.host_us). Run it on two trees
(``PYTHONPATH`` first) to compare launch paths on the same machine.

With verification on, a load's calls differ (the first notes the load, the last may launch the check),
so a verifying pool is timed over whole loads, every layer of the shape in turn, and its figure is the
mean per call: ``verified_in_copy_us`` (the copy checks: ``HICACHE_VERIFY_IN_COPY``'s way) and
``verified_apart_us`` (a check kernel after the last layer), beside ``plain_load_us``, the same whole loads
unverified, and SGLang's function on the same pool, the same run (``sglang_us``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from functools import partial
from pathlib import Path

import torch

import hicache_core as hc
from hicache_core.tools.shapes import SHAPES

# The clock from this repository's tree, whichever hicache_core PYTHONPATH puts first (an older tree has none).
_CLOCK = Path(__file__).parents[1] / "hicache_core" / "tools" / "bench" / "clock.py"
_spec = importlib.util.spec_from_file_location("_bench_clock", _CLOCK)
_clock = sys.modules["_bench_clock"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_clock)
host_us = _clock.host_us

CASES = (("deepseek-mla", "page_first"), ("deepseek-mla", "layer_first"), ("llama-8b", "page_first"),
         ("llama-8b", "layer_first"))  # fmt: skip
IMPLS = ("jit.one_layer", "kernel.triton_uva")


def empty_triton_us() -> float:
    import triton

    @triton.jit
    def empty(x):
        pass

    x = torch.zeros(1, device="cuda")
    compiled = empty[(1,)](x)
    run = compiled.run
    stream = torch.cuda.current_stream().cuda_stream
    head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
            None, None, None)  # fmt: skip
    ptr = x.data_ptr()
    return host_us(lambda: run.launch(1, 1, 1, stream, *head, ptr))


def whole_load_us(host, dev, h, d, layers: int) -> float:
    """Mean host µs per per-layer call over whole loads of ``layers`` layers through ``host``."""

    def load() -> None:
        for layer in range(layers):
            host.load_to_device_per_layer(dev, h, d, layer, "kernel")

    return host_us(load, calls=max(20, 2000 // layers)) / layers


def verified_rows(shape: str, layout: str, dev, h, d, anchor) -> dict:
    """Whole 64-token loads through a plain, an in-copy verified and an apart verified pool of kernel.triton_uva,
    and SGLang's function for the same per-layer load, in that order (the same pool's buffers for SGLang)."""
    row: dict = {"shape": shape, "layout": layout, "implementation": "kernel.triton_uva", "layers": dev.layer_num}
    for tag, verify, in_copy in (("plain_load_us", False, False), ("verified_in_copy_us", True, True),
                                 ("verified_apart_us", True, False)):  # fmt: skip
        host = hc.make_host_pool(dev, layout=layout, io_backend="kernel", operations=[hc.LOAD, hc.BACKUP_ALL],
                                 size=4096, implementation="kernel.triton_uva", verify=verify)  # fmt: skip
        if verify:
            host.verifier = host.verification.make_verifier(in_copy=in_copy)
            host.backup_from_device_all_layer(dev, h, d, "kernel")  # the checksums the loads compare with
        host.implementation_for(hc.LOAD).max_ctas = 8
        row[tag] = whole_load_us(host, dev, h, d, dev.layer_num)
        if verify:
            host.check_verified()  # every page clean: nothing may be reported
            row[tag.replace("_us", "_checked_in_copy")] = dict(host.verification.in_copy)
        host.check_dropped()
        if anchor is not None and anchor.available and tag == "plain_load_us":
            from hicache_core.tools.bench.sglang_kernels import AnchorCalls

            calls = AnchorCalls(anchor, host, dev)
            wrong = calls.moved_right(hc.LOAD, h.long(), d.long(), 1)
            row["sglang_function"] = calls.function(hc.LOAD)
            if wrong is None:
                row["sglang_us"] = host_us(calls.call(hc.LOAD, h.long(), d.long(), 1, 8))
            else:
                row["sglang_refused"] = wrong
        host.destroy()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--out")
    parser.add_argument("--verified", action="store_true",
                        help="also whole loads through verifying pools, in copy and apart, and SGLang")  # fmt: skip
    args = parser.parse_args()
    rows = []
    for shape, layout in CASES:
        dev = SHAPES[shape].device_pool(4096, page_size=64, device="cuda", layers=4)
        h = torch.arange(64, device="cuda") + 128
        d = torch.arange(64, device="cuda") + 64
        for name in IMPLS:
            host = hc.make_host_pool(dev, layout=layout, io_backend="kernel", operations=[hc.LOAD], size=4096,
                                     implementation=name, validate=False)  # fmt: skip
            impl = host.implementation_for(hc.LOAD)
            impl.max_ctas = 8
            pool = host_us(partial(host.load_to_device_per_layer, dev, h, d, 1, "kernel"))
            direct = host_us(partial(impl.load_to_device_per_layer, h, d, 1))
            rows.append({"shape": shape, "layout": layout, "implementation": name, "through_pool_us": pool,
                         "implementation_us": direct})  # fmt: skip
            print(f"{args.label:8} {shape:13} {layout:12} {name:18} pool {pool:6.2f} us  implementation {direct:6.2f}")
            host.destroy()
    anchor = None
    if args.verified:  # this tree's verification (an older tree on PYTHONPATH times the plain rows only)
        from verify_cost import fill_random  # beside this file

        from hicache_core.tools.bench.sglang_kernels import find_anchor

        anchor = find_anchor()
        print(f"SGLang anchor: {anchor.module if anchor.available else 'none (' + str(anchor.why_not) + ')'}")
        for shape, layout in CASES:
            dev = SHAPES[shape].device_pool(4096, page_size=64, device="cuda")
            h = torch.arange(64, device="cuda") + 128
            d = torch.arange(64, device="cuda") + 64
            fill_random(dev)
            row = verified_rows(shape, layout, dev, h, d, anchor)
            rows.append(row)
            print(f"{args.label:8} {shape:13} {layout:12} whole loads of {row['layers']} layers, us a call: plain "
                  f"{row['plain_load_us']:6.2f}  verified in copy {row['verified_in_copy_us']:6.2f}  apart "
                  f"{row['verified_apart_us']:6.2f}  SGLang {row.get('sglang_us', float('nan')):6.2f}")  # fmt: skip
            del dev
            torch.cuda.empty_cache()
    floors = {"empty_triton_c_launch_us": empty_triton_us()}
    x = torch.zeros(1, device="cuda")
    floors["torch_add__us"] = host_us(lambda: x.add_(1))
    print(f"{args.label:8} floors: " + "  ".join(f"{k} {v:.2f}" for k, v in floors.items()))
    record = {"label": args.label, "python": platform.python_version(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(), "rows": rows, "floors": floors,
              "anchor": anchor.describe() if anchor is not None else None,
              "hicache_core": hc.__file__, "plugins": {n: sys.modules[n].__file__ for n in ("hicache_jit",
              "hicache_kernel") if n in sys.modules}}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
