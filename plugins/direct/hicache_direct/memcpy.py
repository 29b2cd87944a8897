"""Submitting copy lists: one ``cudaMemcpyBatchAsync`` through ctypes on CUDA, memmove on the CPU.

Why ctypes and not NVIDIA's ``cuda-bindings``: the descriptors are built in numpy
arrays, and ctypes hands the driver their addresses as they are, while
``cuda.bindings.runtime.cudaMemcpyBatchAsync`` takes Python lists and converts them
element by element (measured: about 0.2 us per descriptor plus 3.5 us per call on
this project's CI machine, on top of the driver's own ~0.5 us per descriptor). The
price of ctypes is the ABI, which changed between CUDA 12.8/12.9 (nine arguments,
with ``failIdx``) and 13.0 (eight): calling one through the other segfaults. So the
signature is chosen at run time from ``cudaRuntimeGetVersion()`` of the very
library the symbol comes from, and that library is the CUDA runtime torch already
loaded (found in this process's memory map), never a second one.

Where the batch call is missing (runtime < 12.8) or refused (old driver, graph
capture), copies go one ``cudaMemcpyAsync`` per run; 2-D copies (the MLA halves of
``page_first_kv_split``) always go one ``cudaMemcpy2DAsync`` per run, since the
batch call has no 2-D form.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading
import warnings
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch

from hicache_core.gpu.device import cuda_current_functions
from hicache_core.gpu.knobs import Knob, flag, int_at_least, read_knobs

from .descriptors import Batch
from .variables import RETIRED_THREAD

_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses
_STREAM_PER_THREAD = 2  # cudaStreamPerThread
_SRC_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: read the source in stream order
_LOC_DEVICE, _LOC_HOST = 1, 2  # cudaMemLocationTypeDevice, cudaMemLocationTypeHost
_PREFER_OVERLAP = 1  # cudaMemcpyFlagPreferOverlapWithCompute
_NO_INDEX = (1 << 64) - 1  # SIZE_MAX: what failIdx holds when no single copy is to blame
_BATCH_MIN_VERSION = 12080
_SPLIT_ON_ERROR = 1024
_ABI_13 = 13000
#: Errors after which the batch call is given up for the process, and the copies go one by one.
_UNSUPPORTED = {
    35: "(the driver is older than the runtime)",
    36: "(the driver is too old for the batch call)",
    801: "(not supported here)",
}


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes`` (driver_types.h): the same 24 bytes in CUDA 12.8 to 13.x."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


#: ``cudaMemcpy3DBatchOp`` as a numpy record (112 bytes; offsets read from the structs cuda-bindings 13.5
#: compiles against driver_types.h, and the same in 12.8): two pointer operands, the extent, the order.
BATCH_OP_3D = np.dtype({
    "names": ["src_type", "src_ptr", "src_row", "src_layer", "src_loc", "src_loc_id",
              "dst_type", "dst_ptr", "dst_row", "dst_layer", "dst_loc", "dst_loc_id",
              "width", "height", "depth", "order", "flags"],
    "formats": ["<i4", "<u8", "<u8", "<u8", "<i4", "<i4", "<i4", "<u8", "<u8", "<u8", "<i4", "<i4",
                "<u8", "<u8", "<u8", "<i4", "<u4"],
    "offsets": [0, 8, 16, 24, 32, 36, 40, 48, 56, 64, 72, 76, 80, 88, 96, 104, 108],
    "itemsize": 112,
})  # fmt: skip
_OPERAND_POINTER = 1  # cudaMemcpyOperandTypePointer


class CopyError(RuntimeError):
    """A copy the driver refused; the message names the run (host items, device rows, layer, part)."""


class HostCopier:
    """Runs copy lists between CPU addresses (device pools on the CPU: tests and demos)."""

    path = "memmove"

    def submit(self, batch: Batch, describe: Callable[[Batch, tuple], str]) -> None:
        for dst, src, size in zip(*batch.linear()):
            ctypes.memmove(dst, src, size)
        for dst, dpitch, src, spitch, width, height, _ in batch.copies_2d:
            for row in range(height):
                ctypes.memmove(dst + row * dpitch, src + row * spitch, width)


class CudaCopier:
    """Submits copy lists on the caller's current CUDA stream through the runtime torch loaded.

    Knobs, per instance, each declared once below (:class:`~hicache_core.gpu.knobs.Knob`: its
    check and its variable ``HICACHE_DIRECT_<NAME>``, which sets the instance's starting value):
    ``batch``, ``max_batch``, ``first_batch``, ``streams``, ``prefer_overlap``, ``batch_2d``. A bad value
    raises ``ValueError`` naming the knob (and the variable) and the range.

    Copies are always submitted on the calling thread, on its current stream. Taking a layer-wise
    load off the caller's thread is the core's job (:mod:`hicache_core.loads.layer_loads`), which waits
    only on events already recorded.
    """

    #: Prefix of the knobs' environment variables.
    env_prefix: ClassVar[str] = "HICACHE_DIRECT"

    batch = Knob(
        flag(), env="BATCH", default=True, changed=None,
        doc="Use ``cudaMemcpyBatchAsync`` where the runtime has it; off forces one ``cudaMemcpyAsync`` per run "
            "(the measured fallback).",
    )  # fmt: skip
    max_batch = Knob(
        int_at_least(0), env="MAX_BATCH", default=32, changed=None,
        doc="At most this many copies per batch call (0: no limit), so the copy engine starts on the first ones "
            "while the host submits the rest. 32 measured best on the H200 "
            "(``benchmarks/results/direct-bench-h200.json``): llama-8b load of 4096 tokens 0.81 -> 0.90 of the "
            "ceiling, MLA 0.63 -> 0.73, all-layer backups 0.84 -> 0.97, against one unbounded batch.",
    )  # fmt: skip
    first_batch = Knob(
        int_at_least(0), env="FIRST_BATCH", default=0, changed=None,
        doc="The size of an operation's first batch call (0: as ``max_batch``), the rest going in calls of "
            "``max_batch``; with ``max_batch=0`` the copy engine starts on a small first batch while one call "
            "submits the rest (fewer calls per operation).",
    )  # fmt: skip
    streams = Knob(
        int_at_least(1), env="STREAMS", minimum=1, default=1, changed=None,
        doc="Spread one operation's copies over this many streams (the caller's plus side streams joined back "
            "by events), so that several copy engines work at once.",
    )  # fmt: skip
    prefer_overlap = Knob(
        flag(), env="PREFER_OVERLAP", default=True, changed="_overlap_changed",
        doc="The batch attribute that asks the driver to keep the copies on the copy engine, beside compute.",
    )  # fmt: skip
    batch_2d = Knob(
        flag(), env="BATCH_2D", default=False, changed=None,
        doc="Submit the 2-D copies (``page_first_kv_split``'s halves) as one ``cudaMemcpy3DBatchAsync`` instead "
            "of one ``cudaMemcpy2DAsync`` per run (off until measured on a GPU).",
    )  # fmt: skip
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        lib = cudart()
        self.runtime_version = runtime_version(lib)
        self._memcpy = _fn(lib.cudaMemcpyAsync, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                  ctypes.c_int, ctypes.c_void_p])  # fmt: skip
        self._memcpy2d = _fn(lib.cudaMemcpy2DAsync, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                                      ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                                                      ctypes.c_int, ctypes.c_void_p])  # fmt: skip
        self._is_capturing = _fn(lib.cudaStreamIsCapturing, [ctypes.c_void_p, ctypes.c_void_p])
        self._event_record = _fn(lib.cudaEventRecord, [ctypes.c_void_p, ctypes.c_void_p])
        self._wait_event = _fn(lib.cudaStreamWaitEvent, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint])
        self._error_name = lib.cudaGetErrorName
        self._error_name.restype = ctypes.c_char_p
        self._error_name.argtypes = [ctypes.c_int]
        self._lib = lib
        self._batch_fn, self._batch_abi, self.unavailable = _batch_function(lib, self.runtime_version)
        self._batch3d_fn, self.unavailable_2d = _batch3d_function(lib, self.runtime_version)
        # One attribute entry per direction: sources read in stream order, location hints (used by the
        # driver only for managed or pageable memory) naming host and device.
        self._attrs_h2d = MemcpyAttributes(_SRC_ORDER_STREAM, _MemLocation(_LOC_HOST, 0),
                                           _MemLocation(_LOC_DEVICE, self.index), 0)  # fmt: skip
        self._attrs_d2h = MemcpyAttributes(_SRC_ORDER_STREAM, _MemLocation(_LOC_DEVICE, self.index),
                                           _MemLocation(_LOC_HOST, 0), 0)  # fmt: skip
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._local = threading.local()
        self._get_device, self._get_stream = cuda_current_functions()
        read_knobs(self, self.env_prefix)
        self._overlap_changed()  # the attributes carry the flag, default or not

    def _overlap_changed(self) -> None:
        for attrs in (self._attrs_h2d, self._attrs_d2h):
            attrs.flags = _PREFER_OVERLAP if self._prefer_overlap else 0

    @property
    def path(self) -> str:
        """What one operation is submitted as, in words (for explain, benchmarks and logs)."""
        if self.batch and self._batch_fn is not None:
            return f"cudaMemcpyBatchAsync (CUDA runtime {self.runtime_version}, {self._batch_abi} ABI)"
        why = "disabled (batch=0)" if not self.batch else self.unavailable
        return f"one cudaMemcpyAsync per run: the batch call is {why}"

    def stream(self) -> int:
        """The caller's current stream, read once per operation (two threads may run a load and a
        backup of one pool on two streams at once). The legacy default stream (0) is refused by
        the batch call, so copies go to the per-thread default stream instead: it is a blocking
        stream, so the legacy stream's implicit synchronisation orders them exactly as if they
        had been queued on the legacy stream itself."""
        stream = self._get_stream(self.index)
        return stream if stream else _STREAM_PER_THREAD

    def submit(self, batch: Batch, describe: Callable[[Batch, tuple], str]) -> None:
        stream = self.stream()
        if stream == _STREAM_PER_THREAD and self._get_device() != self.index:
            with torch.cuda.device(self.index):  # the per-thread stream belongs to the current device
                self._submit(batch, describe, stream)
        else:
            self._submit(batch, describe, stream)

    def _submit(self, batch: Batch, describe, stream: int) -> None:
        count = batch.count
        use_batch = False
        if count:
            use_batch = self.batch and self._batch_fn is not None and count > 1
            if use_batch:
                # The batch call has no graph-node form on every runtime: under capture, copy one by one.
                out = self._out()
                self._is_capturing(stream, out[1])
                use_batch = out[0].value == 0
            if use_batch:
                if self.streams > 1 and count >= 2 * self.streams:
                    self._fan_out(batch, describe, stream)
                else:
                    self._batched(batch, describe, stream, 0, count)
            else:
                self._one_by_one(batch, describe, stream, 0, count)
        if batch.copies_2d:
            # The batch call has no graph-node form on every runtime: under capture, 2-D copies one by one.
            if (
                self.batch_2d
                and self._batch3d_fn is not None
                and len(batch.copies_2d) > 1
                and (use_batch or self._not_capturing(stream))
            ):
                self._batched_2d(batch, describe, stream)
            else:
                self._one_by_one_2d(batch, describe, stream, batch.copies_2d)

    def _not_capturing(self, stream: int) -> bool:
        out = self._out()
        self._is_capturing(stream, out[1])
        return out[0].value == 0

    def _one_by_one_2d(self, batch: Batch, describe, stream: int, copies) -> None:
        memcpy2d = self._memcpy2d
        for dst, dpitch, src, spitch, width, height, origin in copies:
            err = memcpy2d(dst, dpitch, src, spitch, width, height, _DEFAULT, stream)
            if err:
                raise CopyError(f"cudaMemcpy2DAsync failed with {self._name(err)} on {describe(batch, origin)}")

    def _batched_2d(self, batch: Batch, describe, stream: int) -> None:
        """Every 2-D copy of the operation as one ``cudaMemcpy3DBatchAsync`` (pointer operands, depth 1)."""
        copies = batch.copies_2d
        ops = self._ops_2d(len(copies))
        dst, dpitch, src, spitch, width, height, _ = zip(*copies)
        ops["src_ptr"], ops["src_row"], ops["src_layer"] = src, spitch, height
        ops["dst_ptr"], ops["dst_row"], ops["dst_layer"] = dst, dpitch, height
        ops["width"], ops["height"] = width, height
        hint = self._attrs_h2d if batch.to_device else self._attrs_d2h
        ops["src_loc"], ops["src_loc_id"] = hint.srcLocHint.type, hint.srcLocHint.id
        ops["dst_loc"], ops["dst_loc_id"] = hint.dstLocHint.type, hint.dstLocHint.id
        ops["flags"] = hint.flags
        ptr = ops.ctypes.data
        if self._batch_abi == "12.8":
            out = self._out()
            out[2].value = _NO_INDEX
            err = self._batch3d_fn(len(copies), ptr, out[3], 0, stream)
            failed = out[2].value if out[2].value < len(copies) else None
        else:
            err = self._batch3d_fn(len(copies), ptr, 0, stream)
            failed = None
        if not err:
            return
        if failed is not None:
            raise CopyError(f"cudaMemcpy3DBatchAsync failed with {self._name(err)} at 2-D copy {failed}: "
                            f"{describe(batch, copies[failed][6])}")  # fmt: skip
        self._one_by_one_2d(batch, describe, stream, copies)
        self._batch3d_fn = None
        self.unavailable_2d = f"refused with {self._name(err)} while each 2-D copy alone succeeded"
        warnings.warn(f"hicache direct: cudaMemcpy3DBatchAsync {self.unavailable_2d}; 2-D copies one by one "
                      "from now on", stacklevel=4)  # fmt: skip

    def _ops_2d(self, n: int) -> np.ndarray:
        """Per-thread ``cudaMemcpy3DBatchOp`` records, grown as needed, constant fields set once."""
        ops = getattr(self._local, "ops_2d", None)
        if ops is None or ops.shape[0] < n:
            ops = np.zeros(max(n, 64), dtype=BATCH_OP_3D)
            ops["src_type"] = ops["dst_type"] = _OPERAND_POINTER
            ops["depth"] = 1
            ops["order"] = _SRC_ORDER_STREAM
            self._local.ops_2d = ops
        return ops[:n]

    def _batched(self, batch: Batch, describe, stream: int, lo: int, hi: int) -> None:
        base_dst, base_src, base_size = batch.dst_ptr, batch.src_ptr, batch.size_ptr
        attrs = ctypes.byref(self._attrs_h2d if batch.to_device else self._attrs_d2h)
        idx = self._attr_idx
        out = self._out()
        fail_idx = out[2]
        start = lo
        while start < hi:
            fn = self._batch_fn
            if fn is None:  # given up on during this operation: the rest one by one
                self._one_by_one(batch, describe, stream, start, hi)
                return
            size = self.first_batch if start == lo and self.first_batch else self.max_batch
            n = min(size or hi - start, hi - start)
            off = start * 8
            if self._batch_abi == "12.8":
                fail_idx.value = _NO_INDEX
                err = fn(base_dst + off, base_src + off, base_size + off, n, attrs, idx, 1, out[3], stream)
            else:
                err = fn(base_dst + off, base_src + off, base_size + off, n, attrs, idx, 1, stream)
            if err:
                failed = None
                if self._batch_abi == "12.8" and fail_idx.value < n:
                    failed = start + fail_idx.value
                self._batch_failed(batch, describe, stream, start, n, err, failed)
            start += n

    def _batch_failed(self, batch: Batch, describe, stream: int, start: int, n: int, err: int, failed) -> None:
        if failed is not None:
            raise CopyError(
                f"cudaMemcpyBatchAsync failed with {self._name(err)} at copy {failed} of {batch.count}: "
                f"{describe(batch, batch.origin(failed))}"
            )
        # No index from the runtime (CUDA 13 dropped failIdx): the copies go one by one, which either
        # names the one that fails or shows that the batch call itself is what the driver refuses.
        self._one_by_one(batch, describe, stream, start, start + n)
        known = _UNSUPPORTED.get(err, "")
        reason = f"refused with {self._name(err)}{' ' + known if known else ''} while each copy alone succeeded"
        if n > _SPLIT_ON_ERROR and err not in _UNSUPPORTED and not 0 < self.max_batch <= _SPLIT_ON_ERROR:
            # Perhaps only too many copies for one call: smaller batches before giving the call up.
            self.max_batch = _SPLIT_ON_ERROR
            warnings.warn(f"hicache direct: cudaMemcpyBatchAsync of {n} copies {reason}; batches of at most "
                          f"{_SPLIT_ON_ERROR} copies from now on", stacklevel=5)  # fmt: skip
            return
        self._batch_fn, self.unavailable = None, reason
        warnings.warn(f"hicache direct: cudaMemcpyBatchAsync {reason}; copying one by one from now on", stacklevel=5)

    def _one_by_one(self, batch: Batch, describe, stream: int, lo: int, hi: int) -> None:
        memcpy = self._memcpy
        for i, (dst, src, size) in enumerate(zip(*batch.linear(lo, hi)), lo):
            err = memcpy(dst, src, size, _DEFAULT, stream)
            if err:
                raise CopyError(
                    f"cudaMemcpyAsync failed with {self._name(err)} at copy {i} of {batch.count}: "
                    f"{describe(batch, batch.origin(i))}"
                )

    def _fan_out(self, batch: Batch, describe, stream: int) -> None:
        """Split the copies over ``streams`` streams: the caller's and side streams forked from it
        by an event and joined back into it by one event each, so the caller's stream order holds."""
        side, fork, joins = self._side_streams(self.streams - 1)
        self._check(self._event_record(fork, stream), "cudaEventRecord")
        bounds = np.linspace(0, batch.count, self.streams + 1).astype(int).tolist()
        self._batched(batch, describe, stream, bounds[0], bounds[1])
        for k, s in enumerate(side):
            self._check(self._wait_event(s, fork, 0), "cudaStreamWaitEvent")
            self._batched(batch, describe, s, bounds[k + 1], bounds[k + 2])
            self._check(self._event_record(joins[k], s), "cudaEventRecord")
            self._check(self._wait_event(stream, joins[k], 0), "cudaStreamWaitEvent")

    def _side_streams(self, count: int):
        """Per thread and device: non-blocking side streams and reusable events (made once)."""
        cached = getattr(self._local, "side", None)
        if cached is None or len(cached[0]) < count:
            with torch.cuda.device(self.index):
                streams = [torch.cuda.Stream(self.index) for _ in range(count)]
                events = [torch.cuda.Event() for _ in range(count + 1)]
                for e in events:
                    e.record()  # creates the CUDA event
            cached = self._local.side = (streams, events, [s.cuda_stream for s in streams],
                                         [e.cuda_event for e in events])  # fmt: skip
        return cached[2][:count], cached[3][0], cached[3][1 : count + 1]

    def _out(self):
        """Per-thread out-parameters of the runtime calls (capture status, failIdx) and their pointers."""
        out = getattr(self._local, "out", None)
        if out is None:
            capture, fail_idx = ctypes.c_int(0), ctypes.c_size_t(_NO_INDEX)
            out = self._local.out = (capture, ctypes.byref(capture), fail_idx, ctypes.byref(fail_idx))
        return out

    def _check(self, err: int, what: str) -> None:
        if err:
            raise CopyError(f"{what} failed with {self._name(err)}")

    def _name(self, err: int) -> str:
        try:
            return f"{self._error_name(err).decode()} ({err})"
        except Exception:  # noqa: BLE001 - the error code is what matters
            return f"CUDA error {err}"


def _fn(fn, argtypes):
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def _batch_function(lib: ctypes.CDLL, version: int):
    """``(function, ABI, why not)`` of ``cudaMemcpyBatchAsync`` for the loaded runtime's version."""
    if version < _BATCH_MIN_VERSION:
        return None, None, f"missing from CUDA runtime {version} (it needs 12.8 or later)"
    try:
        fn = lib.cudaMemcpyBatchAsync
    except AttributeError:
        return None, None, f"not exported by CUDA runtime {version}"
    common = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
              ctypes.c_void_p, ctypes.c_size_t]  # fmt: skip
    if version >= _ABI_13:  # CUDA 13.0 dropped failIdx (eight arguments)
        return _fn(fn, [*common, ctypes.c_void_p]), "13.0", None
    return _fn(fn, [*common, ctypes.c_void_p, ctypes.c_void_p]), "12.8", None


def _batch3d_function(lib: ctypes.CDLL, version: int):
    """``(function, why not)`` of ``cudaMemcpy3DBatchAsync`` (its ABI changed with the 1-D call's)."""
    if version < _BATCH_MIN_VERSION:
        return None, f"missing from CUDA runtime {version} (it needs 12.8 or later)"
    try:
        fn = lib.cudaMemcpy3DBatchAsync
    except AttributeError:
        return None, f"not exported by CUDA runtime {version}"
    if version >= _ABI_13:  # (numOps, opList, flags, stream)
        return _fn(fn, [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p]), None
    # 12.8/12.9: (numOps, opList, failIdx, flags, stream)
    return _fn(fn, [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p]), None


def runtime_version(lib: ctypes.CDLL) -> int:
    version = ctypes.c_int(0)
    lib.cudaRuntimeGetVersion(ctypes.byref(version))
    return version.value


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
            version = runtime_version(lib)
            if str(version // 1000) != major:
                errors.append(f"{path}: CUDA runtime {version} is not torch's CUDA {torch.version.cuda}")
                continue
            return lib
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
    raise OSError("could not load the CUDA runtime (libcudart): " + "; ".join(errors[-3:]))


RETIRED_THREAD_ENV = RETIRED_THREAD.name


def copier_for(device: torch.device) -> HostCopier | CudaCopier:
    """The copier for a device pool on ``device``."""
    RETIRED_THREAD.read()  # refuses any value but 0, saying why (see hicache_direct.variables)
    return CudaCopier(device) if device.type == "cuda" else HostCopier()
