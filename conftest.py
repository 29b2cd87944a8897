"""The repository's root conftest: a test-only speed-up of Triton's interpreter (``TRITON_INTERPRET=1``).

Under the interpreter, every call of a nested ``@triton.jit`` device function
(``InterpretedFunction.__call__``) runs ``_patch_lang`` again, an ``inspect.getmembers`` over
``triton.language`` and its tensor class, although the kernel launch around it
(``GridExecutor.__call__``) has already patched the same modules: a third of the kernel
conformance suite's interpreter time. The re-patch installs equivalent functions (the same global
``interpreter_builder``); its scope is never restored, and the launch's own restore, last in first out,
puts back the originals it recorded before either. So, while one launch's patch is in place on this
thread and no other launch runs, a nested call whose function sees only modules that launch patched
skips it, and the state after the launch is what Triton leaves. A nested call that sees a module the
launch did not patch (``triton.language.core``: Triton's standard functions such as ``tl.zeros``, under
a kernel that imports only ``triton.language``) runs Triton's own ``_patch_lang`` the first time in the
launch; Triton never restores that patch, so later calls in the same launch skip it too. Nested calls
with no launch active or with another thread's launch beside it run Triton's own ``_patch_lang``.

Second (``install_check``), Triton's overflow check (``TritonSemantic.binary_op_sanitize_overflow_impl``)
recomputes every add, subtract and multiply of integers narrower than 64 bits in int64 and hands the range
check to ``device_assert``, which returns at once unless the builder's options ask for debug; the
interpreter's never do (``InterpreterOptions()``). The check was computed and dropped on every such
operation, a fifth of the kernel conformance suite's interpreter time and of SGLang's suite's; it now runs
only where ``device_assert`` would act on it. It is pinned per triton on its own (``_CHECK_PINNED``: the
core's 3.6.0 and the SGLang environment's 3.8.0).

Both lean on the interpreter's internals, so they are pinned. The first: triton 3.6.0 (scripts/dev's pin),
and the source of each function it replaces or relies on is hashed and compared before it is installed. On
any other triton it is not installed (the SGLang environment has triton 3.8.0 and loads this file
too), and tests/test_triton_interpreter_patch.py, in the core suite, fails naming what differs: a
triton change in scripts/dev fails CI loudly until the new interpreter is read and ``_PINNED``
updated; the second likewise, in each of its environments (the SGLang suite's
test_triton_interpreter_check.py). GPU runs (no ``TRITON_INTERPRET``) install neither.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import threading
from dataclasses import dataclass

_TRITON_VERSION = "3.6.0"
#: sha256 of inspect.getsource of what the speed-up replaces or relies on, in triton 3.6.0.
_PINNED = {
    "_patch_lang": "e5beeba74ada48294c1d0dbee3e55a5ac185992e2197b7ee706f3f061d880989",
    "_patch_builtin": "3c21c270fa61fb24d402b2c9bf3d3981f0c8ebaf42e8fd8322872935e60735ce",
    "_patch_attr": "935587c8b82c3fb075384a29591150254569ff06ecb167e99355754e65c65d93",
    "_patch_lang_tensor": "efc91e4a5c969e2c7e14b35acb5f4bb9e47290c7a45189eb8840b1b6918d1e9a",
    "_patch_lang_core": "72864625d91b5cd02538367d871f957cba27e8789442b80d38742c47bcb9e2bb",
    "_patch_reduce_scan": "ff294418b913c41c56f2ff2b7cc4a104081395c8e676c73d60e118c83cfc7852",
    "_LangPatchScope": "1b26f629cd7367a8d24ead385f65b25b7bac0c2e3afeecb939900c00c356efd8",
    "GridExecutor.__call__": "a8a9450a0a0406a335b61e41b531dfec7b8976ff394f286affa49ebb987f3d2f",
    "InterpretedFunction.__call__": "f2446df46264004916b677478c2eef6ef349bd2c04a99da9eade596b78cd54d8",
}
_CHECK = "TritonSemantic.binary_op_sanitize_overflow_impl"
_ASSERT = "TritonSemantic.device_assert"
#: The overflow check's speed-up, per triton (the core's 3.6.0 and the SGLang environment's 3.8.0): sha256 of the
#: check it replaces and of the assert its equivalence rests on.
_CHECK_PINNED = {
    "3.6.0": {_CHECK: "1ad65a10738d191c7a22b4ba157b323c9e7fa1744280946f33716d86ec3de5a2",
              _ASSERT: "903c1a211e4087202be7bd766a739d01c5356b24318ff6db1037a81e4c2623d6"},
    "3.8.0": {_CHECK: "bdd7f3e24aa645ab7d9560d3c8df63c971f33d54937cb3ed5851e3c7d2eb9467",
              _ASSERT: "903c1a211e4087202be7bd766a739d01c5356b24318ff6db1037a81e4c2623d6"},
}  # fmt: skip


@dataclass(eq=False)  # removed by identity: two launches may hold equal fields
class _Launch:
    """A kernel launch whose patch is in place now: its thread, and the ids of the language modules patched
    since it began (its own, and those a nested call's re-patch added: Triton never restores those)."""

    thread: int
    langs: set[int]


_active: list[_Launch] = []
installed = False
check_installed = False
#: Triton's own functions that install() replaced, by their _PINNED and _CHECK_PINNED names.
_replaced: dict[str, object] = {}


def _sources(interpreter, names=_PINNED) -> dict[str, str]:
    # what is replaced, and what the skip's equivalence rests on: which attributes a patch sets, and how
    # a launch restores them
    sources = {}
    for name in names:
        obj = interpreter
        for part in name.split("."):
            obj = getattr(obj, part)
        sources[name] = inspect.getsource(_replaced.get(name, obj))
    return sources


def _langs(fn, tl) -> frozenset[int]:
    # the modules triton's _patch_lang patches for fn: those of its globals that are triton.language(.core)
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def mismatches(version: str, interpreter) -> list[str]:
    """What differs from the triton the speed-up was written for (empty: the pinned one)."""
    mismatched = [] if version == _TRITON_VERSION else [f"triton {version}"]
    for name, source in _sources(interpreter).items():
        if hashlib.sha256(source.encode()).hexdigest() != _PINNED[name]:
            mismatched.append(name)
    return mismatched


def check_mismatches(version: str, interpreter) -> list[str]:
    """What differs from the tritons the overflow check's speed-up was written for (empty: a pinned one)."""
    pinned = _CHECK_PINNED.get(version)
    if pinned is None:
        return [f"triton {version}"]
    return [name for name, source in _sources(interpreter, pinned).items()
            if hashlib.sha256(source.encode()).hexdigest() != pinned[name]]  # fmt: skip


def install_check() -> None:
    """Run Triton's overflow check only where its assert acts (once), on a pinned triton only."""
    global check_installed
    if check_installed:
        return
    import triton
    from triton.runtime import interpreter

    if check_mismatches(triton.__version__, interpreter):
        return  # Triton's own check runs; this environment's test of the speed-up fails, naming what differs
    check = interpreter.TritonSemantic.binary_op_sanitize_overflow_impl

    def check_where_asserted(self, lhs, rhs, binary_op):
        # Besides two asserts of what its caller already made so (equal integer operand types), its one effect
        # is a device_assert, which does nothing without debug (pinned above).
        if self.builder.options.debug:
            return check(self, lhs, rhs, binary_op)

    _replaced[_CHECK] = check
    interpreter.TritonSemantic.binary_op_sanitize_overflow_impl = check_where_asserted
    check_installed = True


def install() -> None:
    """Install the speed-up into triton.runtime.interpreter (once), on the pinned triton only.

    Elsewhere it leaves Triton alone: the SGLang environment (triton 3.8.0) loads this conftest too.
    """
    global installed
    if installed:
        return
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if mismatches(triton.__version__, interpreter):
        return  # Triton's own code runs; the core suite's test of this speed-up fails, naming what differs
    patch_lang = interpreter._patch_lang
    rewrite_call = interpreter.InterpretedFunction.__call__

    def launch_patch_lang(fn):
        # GridExecutor.__call__'s patch: recorded as active until its scope is restored
        scope = patch_lang(fn)
        entry = _Launch(threading.get_ident(), set(_langs(fn, tl)))
        _active.append(entry)
        restore = scope.restore

        def restore_and_forget() -> None:
            _active.remove(entry)
            restore()

        scope.restore = restore_and_forget
        return scope

    def device_call(self, *args, **kwargs):
        active = _active[:]
        if len(active) == 1 and active[0].thread == threading.get_ident():
            needed = _langs(self.fn, tl)
            if not needed <= active[0].langs:
                # Triton's own re-patch, never restored (as in Triton): these modules stay patched, so they
                # are covered for the rest of this launch
                patch_lang(self.fn)
                active[0].langs |= needed
        else:
            patch_lang(self.fn)  # Triton's own re-patch (never restored, as in Triton)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    # InterpretedFunction.__call__ calls _patch_lang then runs the rewritten function; device_call does the
    # same minus the redundant patch, so it replaces the method.
    _replaced.update({"_patch_lang": patch_lang, "InterpretedFunction.__call__": rewrite_call})
    interpreter._patch_lang = launch_patch_lang
    interpreter.InterpretedFunction.__call__ = device_call
    installed = True


def pytest_configure(config) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        try:
            import triton  # noqa: F401
        except ImportError:
            return
        install()
        install_check()
