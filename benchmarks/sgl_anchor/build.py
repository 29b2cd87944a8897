"""Build SGLang's ``transfer.cu`` from source into an importable anchor for ``hicache bench``.

sgl-kernel's wheels are built for one torch each and weigh hundreds of MB, so on a machine
whose torch differs (the H200 image) the anchor is SGLang's own kernel source compiled there:

    python benchmarks/sgl_anchor/build.py --src DIR --out /tmp/sgl_anchor
    PYTHONPATH=/tmp/sgl_anchor HICACHE_BENCH_ANCHOR=sgl_transfer_anchor hicache bench ...

``DIR`` holds ``transfer.cu`` from SGLang's ``sgl-kernel/csrc/kvcacheio`` (not part of this
repository). The functions keep sgl-kernel's names and signatures (``binding.cpp``); the
bench checks every call byte for byte before timing it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAME = "sgl_transfer_anchor"


def build(src: Path, out: Path, verbose: bool = False) -> Path:
    from torch.utils.cpp_extension import load

    out.mkdir(parents=True, exist_ok=True)
    # transfer.cu includes sgl-kernel's header of torch helpers; the torch headers are all it needs from it.
    (out / "include").mkdir(exist_ok=True)
    (out / "include" / "pytorch_extension_utils.h").write_text("#pragma once\n#include <torch/all.h>\n")
    start = time.perf_counter()
    load(name=NAME, sources=[str(HERE / "binding.cpp"), str(src / "transfer.cu")], build_directory=str(out),
         extra_include_paths=[str(out / "include")], extra_cflags=["-O3"],
         extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=verbose)  # fmt: skip
    print(f"built {NAME} in {time.perf_counter() - start:.0f} s under {out}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True, help="folder holding SGLang's transfer.cu")
    parser.add_argument("--out", type=Path, default=Path("/tmp/sgl_anchor"))
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    build(args.src, args.out, args.verbose)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
