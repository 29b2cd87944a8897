"""What ``fork()`` costs a process that holds a host pool: with the pool left out of children, and without.

Run on the GPU machine or anywhere on Linux::

    python benchmarks/fork_cost.py --mib 256 --out $OUT/fork-cost.json

Each case runs in a fresh process: one mapping of ``--mib`` MiB made by ``hicache_core.host_memory``'s
``map_host_memory``, touched and pinned, then forked ``--forks`` times. Pinned with ``cudaHostRegister``
where CUDA is; elsewhere by registering it as an io_uring fixed buffer, which pins its pages for the long
term as the NVIDIA driver does (``FOLL_LONGTERM``): the kernel then copies them into every child.
``dontfork`` is the mapping as hicache makes it (``MADV_DONTFORK``); ``inherited`` skips that advice. Per
fork: the seconds ``os.fork()`` took in the parent, and the child's private dirty memory (``smaps_rollup``)
and the system's ``MemAvailable`` in the child against the parent's just before the fork.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time


def _kb(path: str, key: str) -> int:
    for line in open(path):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _pin_io_uring(address: int, length: int) -> int:
    """Pin ``[address, address + length)`` as an io_uring fixed buffer (at most 1 GiB); the ring's fd holds it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = (ctypes.c_uint8 * 120)()  # struct io_uring_params, zeroed
    ring = libc.syscall(425, ctypes.c_uint(4), params)  # io_uring_setup (x86-64 and arm64 share the number)
    if ring < 0:
        raise OSError(ctypes.get_errno(), "io_uring_setup")
    vec = _IOVec(address, length)
    if libc.syscall(427, ctypes.c_int(ring), ctypes.c_uint(0), ctypes.byref(vec), ctypes.c_uint(1)) < 0:
        raise OSError(ctypes.get_errno(), "io_uring_register(IORING_REGISTER_BUFFERS)")
    return ring


def case(mode: str, mib: int, forks: int) -> dict:
    import torch

    from hicache_core.host_memory import mapping

    if mode == "inherited":
        mapping._leave_out_of_children = lambda m, r: None
    cuda = torch.cuda.is_available()
    tensor, record = mapping.map_host_memory(mib << 20, label="fork cost", pin=cuda, node=None, huge_pages=False,
                                             touch_threads=4, chunk_bytes=1 << 40, granule=1)  # fmt: skip
    tensor.fill_(1)
    ring = None if cuda else _pin_io_uring(tensor.data_ptr(), tensor.numel())
    rows = []
    for _ in range(forks):
        reader, writer = os.pipe()
        before = _kb("/proc/meminfo", "MemAvailable")
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            seen = {"private_dirty_kb": _kb("/proc/self/smaps_rollup", "Private_Dirty"),
                    "mem_available_kb": _kb("/proc/meminfo", "MemAvailable")}  # fmt: skip
            os.write(writer, json.dumps(seen).encode())
            os._exit(0)
        seconds = time.perf_counter() - start
        os.close(writer)
        with os.fdopen(reader) as f:
            seen = json.loads(f.read())
        os.waitpid(pid, 0)
        rows.append({"fork_s": seconds, "child_private_dirty_bytes": seen["private_dirty_kb"] << 10,
                     "mem_available_drop_bytes": (before - seen["mem_available_kb"]) << 10})  # fmt: skip
    if ring is not None:
        os.close(ring)
    return {"mode": mode, "bytes": mib << 20, "pinned_by": "cudaHostRegister" if cuda else "io_uring",
            "dontfork": record.dontfork, "forks": rows, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "kernel": os.uname().release}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--forks", type=int, default=5)
    parser.add_argument("--case", choices=("dontfork", "inherited"), help="(internal) run one case here")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(case(args.case, args.mib, args.forks)))
        return
    results = []
    for mode in ("inherited", "dontfork"):
        done = subprocess.run([sys.executable, __file__, "--case", mode, "--mib", str(args.mib), "--forks",
                               str(args.forks)], capture_output=True, text=True, check=True)  # fmt: skip
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for r in results:
        fork_ms = sorted(f["fork_s"] * 1e3 for f in r["forks"])
        dirty = sorted(f["child_private_dirty_bytes"] >> 20 for f in r["forks"])
        print(f"{r['mode']:9} {r['bytes'] >> 20} MiB pinned by {r['pinned_by']}: fork "
              f"{fork_ms[len(fork_ms) // 2]:.1f} ms (median of {len(fork_ms)}), child private dirty "
              f"{dirty[len(dirty) // 2]} MiB")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
