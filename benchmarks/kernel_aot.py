"""Compile the Triton implementations' kernels for a GPU without one (sm_90 by default) and read the result.

For model-shaped pools (full layer counts, so host strides are the real ones), every jit
variant and kernel.triton_uva stage setting is compiled exactly as the runtime JIT would
(the same argument binding and specialisation, through Triton's own ``run(warmup=True)``
path with a stand-in driver that only names the target), with Triton's bundled ptxas. It
prints registers, spills, shared memory and global scratch per kernel, and counts the
memory instructions in the SASS: 16-byte loads (``LDG.E.128``), asynchronous copies
(``LDGSTS``), TMA copies (``UTMALDG``/``UTMASTG``). Costs no device time; run it on the
CPU machine before a GPU sweep:

    python benchmarks/kernel_aot.py                      # every variant, MLA and llama, page_first
    python benchmarks/kernel_aot.py --layouts page_first,page_first_direct --variants rows,tma --sass-dir /tmp/sass
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this compiles real kernels")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

import hicache_core as hc  # noqa: E402
from hicache_core.tools.shapes import SHAPES  # noqa: E402

MEMORY_OPS = re.compile(r"\b(LDG\.E[A-Z0-9.]*|STG\.E[A-Z0-9.]*|LDGSTS[A-Z0-9.]*|UTMALDG[A-Z0-9.]*|UTMASTG[A-Z0-9.]*)")


class TargetOnlyDriver:
    """Enough of a Triton driver to compile (never launch): it names the target and a device 0."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise RuntimeError("compile only")

    def get_empty_cache_for_benchmark(self):
        raise RuntimeError("compile only")

    def clear_cache(self, cache) -> None:
        pass


def _tool(name: str) -> str:
    return os.path.join(triton.__path__[0], "backends", "nvidia", "bin", name)


def inspect_cubin(cubin: bytes, sass_path: str | None) -> dict:
    path = "/tmp/hicache-aot.cubin"
    with open(path, "wb") as f:
        f.write(cubin)
    sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    if sass_path:
        with open(sass_path, "w") as f:
            f.write(sass)
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    ops = collections.Counter(MEMORY_OPS.findall(sass))
    return {
        "regs": int(regs.group(1)) if regs else None,
        "stack": int(stack.group(1)) if stack else None,
        "local": int(local.group(1)) if local else None,
        "ops": dict(sorted(ops.items())),
    }


def compile_impl(impl, label: str, sass_dir: str | None, *, quiet: bool = False) -> list[dict]:
    """Compile every (group, direction) kernel of ``impl`` as its first call would."""
    impl._interpreting = False  # use the real loop settings (the CPU binding would force the interpreter's)
    impl._configure()
    rows = []
    for gi, group in enumerate(impl._groups):
        for to_device in (True, False):
            idx = torch.zeros(64, dtype=torch.int64)
            kernel = impl._kernel_for(group)
            args = group.args[to_device][0]
            call = (impl._anchor, idx, idx, 1, 1, 64, 1, *args)
            t0 = time.perf_counter()
            try:
                compiled = kernel.run(*call, grid=(1,), warmup=True, num_warps=impl.num_warps)
            except Exception as exc:  # noqa: BLE001 - report and go on
                rows.append({"kernel": label, "group": gi, "to_device": to_device, "error": repr(exc)[:300]})
                if not quiet:
                    print(f"  {label:40} {'h2d' if to_device else 'd2h'} FAILED {exc!r}"[:300])
                continue
            seconds = time.perf_counter() - t0
            meta = compiled.metadata
            sass_path = None
            if sass_dir:
                os.makedirs(sass_dir, exist_ok=True)
                way = "h2d" if to_device else "d2h"
                sass_path = os.path.join(sass_dir, f"{label.replace('/', '_')}-g{gi}-{way}.sass")
            info = inspect_cubin(compiled.asm["cubin"], sass_path)
            row = {"kernel": label, "group": gi, "to_device": to_device, "seconds": seconds, "shared": meta.shared,
                   "scratch": meta.global_scratch_size, "num_warps": meta.num_warps, **info}  # fmt: skip
            rows.append(row)
            ops = " ".join(f"{k}x{v}" for k, v in info["ops"].items())
            if not quiet:
                print(f"  {label:40} {'h2d' if to_device else 'd2h'} {seconds:5.2f}s regs={info['regs']:>3} "
                      f"stack={info['stack']} smem={meta.shared:>6} scratch={meta.global_scratch_size:>3} "
                      f"{ops}")  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="deepseek-mla,llama-8b")
    p.add_argument("--layouts", default="page_first")
    p.add_argument("--variants", default="", help="jit variants (default: all)")
    p.add_argument("--kernel-stages", default="0,4", help="kernel.triton_uva stage settings to compile")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--sass-dir", default=None)
    args = p.parse_args()

    driver.set_active(TargetOnlyDriver(args.arch))
    from hicache_jit import VARIANTS, JitOneLayer
    from hicache_kernel import TritonUVA

    variants = [v for v in args.variants.split(",") if v] or list(VARIANTS)
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        for layout in args.layouts.split(","):
            dev = shape.device_pool(4096, page_size=64, device="cpu")
            host = hc.make_host_pool(dev, layout=layout, io_backend="reference", size=4096, operations=())
            print(f"== {shape_name} {layout}")
            for variant in variants:
                impl = JitOneLayer(host.plan)
                impl.variant = variant
                compile_impl(impl, f"jit/{variant}", args.sass_dir)
            for stages in (int(s) for s in args.kernel_stages.split(",") if s):
                impl = TritonUVA(host.plan)
                impl.stages = stages
                compile_impl(impl, f"kernel/stages={stages}", args.sass_dir)
            del host, dev
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
