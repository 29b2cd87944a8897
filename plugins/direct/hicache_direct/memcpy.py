"""Raw-pointer copies: the CUDA runtime's ``cudaMemcpyAsync``/``cudaMemcpy2DAsync`` through ctypes, or memmove on CPU.

Building a tensor view per contiguous run and calling ``copy_`` costs several
microseconds of host time per copy, more than a 64-token page takes on the link;
a ctypes call with precomputed addresses costs about one. The runtime library is
the one torch already loaded (found in this process's memory map), so no second
CUDA runtime is ever loaded.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import torch

_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses


class HostCopier:
    """Copies between CPU addresses (device pools on the CPU: tests and demos)."""

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    def begin(self) -> int:
        return 0


class CudaCopier:
    """Asynchronous copies on the current torch stream through the CUDA runtime torch loaded."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        lib = cudart()
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._memcpy2d = lib.cudaMemcpy2DAsync
        self._memcpy2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                   ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]  # fmt: skip
        self._memcpy2d.restype = ctypes.c_int

    def begin(self) -> int:
        """The caller's current stream, read once per operation (returned, not stored: two threads may
        run a load and a backup of one pool on two streams at once)."""
        return torch.cuda.current_stream(self.device).cuda_stream

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self._memcpy(dst, src, nbytes, _DEFAULT, stream)
        if err:
            raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {err} ({nbytes} bytes)")

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
        err = self._memcpy2d(dst, dpitch, src, spitch, width, height, _DEFAULT, stream)
        if err:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err} ({height} rows of {width} bytes)")


@functools.lru_cache(maxsize=1)
def cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch uses (loaded once, on first use)."""
    torch.cuda.init()
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            candidates = sorted({line.split()[-1] for line in maps if "libcudart" in line and "/" in line})
    except OSError:
        pass
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates += glob.glob(os.path.join(torch_lib, "libcudart*.so*"))
    # Last resort, by name: accepted only if its major version is torch's (never a second runtime).
    major = (torch.version.cuda or "0").split(".")[0]
    candidates += [f"libcudart.so.{major}", "libcudart.so"]
    errors = []
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            lib.cudaMemcpyAsync  # noqa: B018 - probe the symbol
            version = ctypes.c_int(0)
            lib.cudaRuntimeGetVersion(ctypes.byref(version))
            if str(version.value // 1000) != major:
                errors.append(f"{path}: CUDA runtime {version.value} is not torch's CUDA {torch.version.cuda}")
                continue
            return lib
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
    raise OSError("could not load the CUDA runtime (libcudart): " + "; ".join(errors[-3:]))


def copier_for(device: torch.device):
    return CudaCopier(device) if device.type == "cuda" else HostCopier()
