"""Host time per 64-token load (the bar: <= 8 us per call), and the floors beneath it.

    python benchmarks/host_time.py --label new --out host-time.json

For jit.one_layer and kernel.triton_uva on MLA and llama-8b pools (page_first and layer_first,
page size 64, 8 CTAs): a call through the host pool (what a server pays) and a call to the
implementation; beside them the floors: Triton's C launcher on an empty kernel, a torch ``add_``,
and, where it imports, SGLang's function for the same load (``HICACHE_BENCH_ANCHOR``). Each figure
is the median of 5 batches of 1000 calls (hicache_core.tools.bench.clock.host_us). Run it on two trees
(``PYTHONPATH`` first) to compare launch paths on the same machine.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--out")
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
    floors = {"empty_triton_c_launch_us": empty_triton_us()}
    x = torch.zeros(1, device="cuda")
    floors["torch_add__us"] = host_us(lambda: x.add_(1))
    print(f"{args.label:8} floors: " + "  ".join(f"{k} {v:.2f}" for k, v in floors.items()))
    record = {"label": args.label, "python": platform.python_version(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(), "rows": rows, "floors": floors,
              "hicache_core": hc.__file__, "plugins": {n: sys.modules[n].__file__ for n in ("hicache_jit",
              "hicache_kernel") if n in sys.modules}}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
