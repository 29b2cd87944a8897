"""The conformance kit never crashes the test run: a case that kills its process fails, and later cases run.

A planted implementation faults on every page-size-1 case and is correct on the others. On a CPU the
fault is a process abort (``os.abort()``) or a segmentation fault (a read of address 0 through
ctypes): what an out-of-bounds access on the device does to a process. On CUDA it is the real thing,
an index past the end of the device pool with no bounds check: a device-side assert that breaks the
CUDA context (``test_an_out_of_bounds_index_on_cuda_fails_its_case_and_later_cases_run``, for the
GPU gate). The kit runs in a separate pytest process (``runpytest_subprocess``), so that if isolation
ever broke, this test would fail instead of taking the test run down with it.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest_plugins = ["pytester"]

FAULTY = '''
import ctypes
import os

import torch

import hicache_core as hc
from hicache_core import hookimpl


class Faulty(hc.Implementation):
    """The reference copy, except on page-size-1 pools, where it faults as HICACHE_TEST_FAULT says."""

    name = "crash.faulty"
    io_backend = "crash_faulty"
    device_types = frozenset({"cpu", "cuda"})
    index_dtypes = frozenset({torch.int32, torch.int64})
    operations = frozenset({"load_to_device_per_layer"})

    def load_to_device_per_layer(self, h, d, layer):
        if self.plan.tokens_per_page == 1:
            self.fault(h, d, layer)
        hc.reference_copy(self.plan, h, d, [layer], to_device=True)

    def fault(self, h, d, layer):
        how = os.environ["HICACHE_TEST_FAULT"]
        if how == "abort+segv":  # the sharded pool (2 owned layers) segfaults, the others abort
            how = "segv" if self.plan.num_layers == 2 else "abort"
        if how == "abort":
            os.abort()
        if how == "segv":
            ctypes.string_at(0)
        if how == "oob":  # no bounds check: a gather past the end of the device pool, on the device
            rows = self.plan.parts[0].device_layer_view(layer)
            far = d.to(rows.device) + rows.shape[0] * 1000
            rows.index_select(0, far).sum().item()
        raise AssertionError(f"HICACHE_TEST_FAULT={how!r}")


class CrashPlugin:
    @hookimpl
    def hicache_register_backends(self, register):
        register(Faulty)
'''


def _kit_module(device: str | None, isolate: bool | None) -> str:
    lines = [f"    device = {device!r}"] if device else []
    lines += [f"    isolate = {isolate!r}"] if isolate is not None else []
    return textwrap.dedent(
        """
        from hicache_core.testing import ConformanceTests
        from crashimpls import CrashPlugin


        class TestCrash(ConformanceTests):
            implementation = "crash.faulty"
            plugins = {"crashplugin": CrashPlugin()}
            only_pool_kinds = ("mla",)
            only_layouts = ("page_first",)
            only_operations = ("load_to_device_per_layer",)
            page_sizes = (1, 64)
            index_dtypes = ("int64",)
        """
    ) + "\n".join(lines) + "\n"


def _run(pytester, monkeypatch, fault: str, *, device: str | None = None, isolate: bool | None = True):
    monkeypatch.setenv("HICACHE_TEST_FAULT", fault)
    pytester.makepyfile(crashimpls=FAULTY, test_crash=_kit_module(device, isolate))
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "test_round_trip or test_beside", "-rfs",
                                         timeout=300)  # fmt: skip


def test_a_case_that_kills_its_process_fails_and_later_cases_run(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "abort+segv", device="cpu")  # on CUDA test_beside would run too
    out = result.stdout.str()
    # plain/sharded/draft x p1/p64, in that order: each crash (p1) is followed by a case that passes (p64).
    assert result.parseoutcomes().get("failed") == 3 and result.parseoutcomes().get("passed") == 3, out
    assert result.ret == 1, out  # tests failed; the run itself completed, with its summary
    for variant, signal in (("plain", "SIGABRT"), ("sharded", "SIGSEGV"), ("draft", "SIGABRT")):
        result.stdout.fnmatch_lines([
            f"*crash.faulty (plugin crashplugin) [[]mla-page_first-load_to_device_per_layer-{variant}-p1-int64[]] "
            f"crashed the process it ran in (the case worker exited during the case: killed by {signal} (rc -*)); "
            "the run goes on*",
        ])  # fmt: skip
        result.stdout.fnmatch_lines([f"FAILED *test_round_trip[[]mla-page_first-*-{variant}-p1-*"])
        result.stdout.no_fnmatch_line(f"FAILED *test_round_trip[[]*-{variant}-p64-*")
    # The error it raised: the worker's last words name the fault and where it happened.
    result.stdout.fnmatch_lines(["*Fatal Python error: Aborted*", "*crashimpls.py*in fault"], consecutive=False)
    result.stdout.fnmatch_lines(["*Fatal Python error: Segmentation fault*", "*crashimpls.py*in fault"],
                                consecutive=False)  # fmt: skip
    result.stdout.fnmatch_lines(["SKIPPED *needs CUDA*"])  # a skip inside the worker is the case's skip


def test_without_isolation_the_same_fault_takes_the_run_down(pytester, monkeypatch):
    """The control: isolate = False on a CPU runs cases in the pytest process, which the abort kills."""
    result = _run(pytester, monkeypatch, "abort", isolate=False)
    assert result.ret in (-6, 134), result.stdout.str()  # SIGABRT, or a shell's 128 + 6
    result.stdout.no_fnmatch_line("*passed*")  # no summary: the report is lost with the process


def test_isolation_follows_the_environment_and_defaults_to_cuda(monkeypatch):
    from hicache_core.testing import ConformanceTests

    class OnCpu(ConformanceTests):
        implementation = "direct.copy_engine"
        device = "cpu"

    class OnCuda(OnCpu):
        device = "cuda"

    monkeypatch.delenv("HICACHE_KIT_ISOLATE", raising=False)
    assert not OnCpu.isolated() and OnCuda.isolated()
    monkeypatch.setenv("HICACHE_KIT_ISOLATE", "1")
    assert OnCpu.isolated()
    monkeypatch.setenv("HICACHE_KIT_ISOLATE", "0")
    assert not OnCuda.isolated()
    monkeypatch.setenv("HICACHE_KIT_ISOLATE", "yes")
    with pytest.raises(ValueError, match="HICACHE_KIT_ISOLATE='yes'"):
        OnCpu.isolated()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a device-side assert breaks a CUDA context")
def test_an_out_of_bounds_index_on_cuda_fails_its_case_and_later_cases_run(pytester, monkeypatch):
    """On the GPU: no bounds check, an index past the end of the device pool. Isolation is the CUDA default."""
    result = _run(pytester, monkeypatch, "oob", device="cuda", isolate=None)
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 3 and outcomes.get("passed", 0) >= 3, out
    assert result.ret == 1, out
    result.stdout.fnmatch_lines(["*crash.faulty (plugin crashplugin) [[]mla-page_first-*-plain-p1-int64[]]*"])
    assert "device-side assert" in out or "illegal memory access" in out or "crashed the process" in out, out
    for variant in ("plain", "sharded", "draft"):
        result.stdout.no_fnmatch_line(f"FAILED *test_round_trip[[]*-{variant}-p64-*")
