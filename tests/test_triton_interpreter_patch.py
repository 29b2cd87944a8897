"""The root conftest's speed-up of Triton's interpreter: same results, same patch state after a launch.

It skips a nested device function's redundant ``_patch_lang`` while the kernel launch around it has
patched the same modules, and Triton's overflow check where nothing would act on its result (conftest.py
says why both are safe, and is pinned to triton 3.6.0).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter
from triton_core_only import double_at

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")


@pytest.fixture
def speedup(request):
    """The root conftest module (a pytest plugin), which installed the speed-up."""
    root = Path(str(request.config.rootpath)) / "conftest.py"
    for plugin in request.config.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) == str(root):
            assert plugin.installed, (
                "TRITON_INTERPRET=1 but the root conftest did not install its speed-up; it differs from "
                f"the triton it was written for in {plugin.mismatches(triton.__version__, interpreter)}"
            )
            return plugin
    raise AssertionError(f"{root} is not loaded")


@triton.jit
def plus_one(ptr, offsets):
    return tl.load(ptr + offsets) + 1


@triton.jit
def row_sum(ptr, offsets):
    return tl.sum(tl.load(ptr + offsets), axis=0)


@triton.jit
def nested_kernel(src, dst, total, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(dst + offsets, plus_one(src, offsets) + double_at(src, offsets) + double_at(src, offsets))
    tl.store(total, row_sum(src, offsets))


@triton.jit
def add_int32(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, tl.load(a_ptr + offsets) + tl.load(b_ptr + offsets))


def _lang_state() -> dict[str, object]:
    # attributes every kind of patch touches: a builtin (module and tensor method), Triton's own
    # replacements (range, reduce), the dtype's to_ir, in both triton.language and triton.language.core.
    # An original is itself; a patched one is its kind (Triton's unrestored re-patches leave a new
    # closure of the same kind per call)
    values = {
        "tl.load": tl.load,
        "tl.sum": tl.sum,
        "tl.range": tl.range,
        "tl.reduce": tl.reduce,
        "tl.tensor.__add__": tl.tensor.__add__,
        "tl.tensor.__bool__": getattr(tl.tensor, "__bool__", None),
        "tl.dtype.to_ir": tl.dtype.to_ir,
        "core.load": tl.core.load,
        "core.reduce": tl.core.reduce,
        "core.range": tl.core.range,
    }
    return {
        name: ("patched", value.__qualname__) if "_patch" in getattr(value, "__qualname__", "") else value
        for name, value in values.items()
    }


def _run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    src = torch.arange(8, dtype=torch.int32)
    dst = torch.zeros(8, dtype=torch.int32)
    total = torch.zeros(1, dtype=torch.int32)
    nested_kernel[(1,)](src, dst, total, N=8)
    return src, dst, total


def test_pinned_triton_matches(speedup):
    # scripts/dev installs triton==3.6.0; a change there fails here until conftest.py's _PINNED is updated
    assert speedup.mismatches(triton.__version__, interpreter) == []
    assert interpreter.InterpretedFunction.__call__.__name__ == "device_call"
    assert speedup.check_mismatches(triton.__version__, interpreter) == []
    assert speedup.check_installed
    assert interpreter.TritonSemantic.binary_op_sanitize_overflow_impl.__name__ == "check_where_asserted"


def test_a_changed_interpreter_is_refused(speedup, monkeypatch):
    monkeypatch.setitem(speedup._PINNED, "_patch_lang", "0" * 64)
    assert speedup.mismatches(triton.__version__, interpreter) == ["_patch_lang"]
    assert speedup.mismatches("3.7.0", interpreter)[0] == "triton 3.7.0"
    assert speedup.check_mismatches("3.7.0", interpreter) == ["triton 3.7.0"]
    monkeypatch.setitem(speedup._CHECK_PINNED[triton.__version__], speedup._ASSERT, "0" * 64)
    assert speedup.check_mismatches(triton.__version__, interpreter) == [speedup._ASSERT]


def test_nested_calls_compute_and_the_launch_restores(speedup):
    # the nested function of another module sees triton.language.core only: the launch (which patched
    # triton.language) does not cover it, so Triton's own re-patch runs for it; Triton never restores that
    # re-patch, so the first launch may leave triton.language.core's builtins patched: compare after it
    _run()
    before = _lang_state()
    src, dst, total = _run()
    assert dst.tolist() == [(x + 1) + 4 * x for x in src.tolist()]
    assert total.item() == sum(src.tolist())
    assert speedup._active == []
    after = _lang_state()
    assert after == before, [k for k in before if before[k] is not after[k]]
    # what the launch patched (triton.language, the tensor and dtype classes) is back to Triton's own
    assert [k for k, v in after.items() if k.startswith("tl.") and isinstance(v, tuple)] == []


def test_same_state_as_tritons_own(speedup, monkeypatch):
    # the module state after a launch, with the speed-up and with Triton's own InterpretedFunction.__call__
    _run()
    fast = _lang_state()
    tritons_own = speedup._replaced["InterpretedFunction.__call__"]
    monkeypatch.setattr(interpreter.InterpretedFunction, "__call__", tritons_own)
    src, dst, total = _run()
    assert dst.tolist() == [(x + 1) + 4 * x for x in src.tolist()]
    assert _lang_state() == fast


def test_builtins_outside_a_launch_are_triton_s(speedup):
    # no launch active: a builtin called outside a kernel still fails as Triton makes it fail
    _run()
    with pytest.raises(ValueError, match="Did you forget to add @triton.jit"):
        tl.arange(0, 8)


def _add_past_int32_max() -> list[int]:
    a = torch.tensor([2**31 - 1, 5], dtype=torch.int32)
    out = torch.zeros(2, dtype=torch.int32)
    add_int32[(1,)](a, torch.ones(2, dtype=torch.int32), out, N=2)
    return out.tolist()


def test_the_overflow_check_acts_as_triton_s_without_debug_and_with_it(speedup, monkeypatch):
    # without debug (the interpreter's options) an int32 overflow wraps, as with Triton's own check
    assert _add_past_int32_max() == [-(2**31), 6]
    with monkeypatch.context() as m:
        m.setattr(interpreter.TritonSemantic, "binary_op_sanitize_overflow_impl",
                  speedup._replaced["TritonSemantic.binary_op_sanitize_overflow_impl"])  # fmt: skip
        assert _add_past_int32_max() == [-(2**31), 6]
    # with debug the check runs and Triton's assert reports the overflow
    monkeypatch.setattr(interpreter.interpreter_builder, "options", interpreter.InterpreterOptions(debug=True))
    with pytest.raises(Exception, match="int32 overflow detected for operation add"):
        _add_past_int32_max()
