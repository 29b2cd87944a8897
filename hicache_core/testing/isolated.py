"""Conformance cases in a child process, so that no case can crash the test run.

A case whose implementation faults (an out-of-bounds access that aborts the process, a
device-side assert, an illegal address that breaks the CUDA context) would otherwise take
the pytest process with it: no report, and no later case. With isolation on
(:attr:`ConformanceTests.isolate`; by default on CUDA), the kit's pytest plugin hands each
case of a matrix test to a **case worker**, a child Python process that imports the test
module, builds the same case and runs the test's body. The worker answers ``passed``,
``skipped`` with the reason, or ``failed`` with the message; pytest reports that as the
case's own outcome. When the worker dies (a signal, ``os.abort()``, a C++ ``abort`` in a
driver) or the case leaves its CUDA context broken, that case fails with what happened, its
case id and the end of the worker's stderr, the worker is replaced, and the next case runs
in a fresh process with a fresh CUDA context.

One worker serves the session, case after case (a process start and CUDA initialisation per
case would cost seconds each). Its protocol is one JSON line per request and per answer, on
a file descriptor of its own: what a case prints goes to the worker's stderr, not into the
protocol.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from typing import IO, Any

from ..settings.variables import KIT_CASE_TIMEOUT, KIT_WORKER_FD

#: Seconds one case may run in the worker before it counts as hung (the worker is then killed).
CASE_TIMEOUT: float = KIT_CASE_TIMEOUT.read()
#: The end of a dead worker's stderr quoted in the failure (the driver's last words).
STDERR_TAIL = 3000


class _Worker:
    """The parent's handle on one case worker process."""

    def __init__(self) -> None:
        self.stderr: IO[bytes] = tempfile.TemporaryFile()
        read_fd, write_fd = os.pipe()
        env = {**os.environ, KIT_WORKER_FD.name: str(write_fd)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from hicache_core.testing.isolated import worker_main; worker_main()"],
            stdin=subprocess.PIPE,
            stdout=self.stderr,
            stderr=self.stderr,
            pass_fds=(write_fd,),
            env=env,
        )
        os.close(write_fd)
        self.answers = os.fdopen(read_fd, "rb")
        assert self.proc.stdin is not None
        self.requests = self.proc.stdin
        self.requests.write((json.dumps({"sys_path": sys.path}) + "\n").encode())
        self.requests.flush()

    def run(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one case; its answer, or ``{"outcome": "crashed", ...}`` when the worker died or hung."""
        try:
            self.requests.write((json.dumps(request) + "\n").encode())
            self.requests.flush()
        except (BrokenPipeError, OSError):
            return self._dead("the case worker had exited before the case was sent")
        ready, _, _ = select.select([self.answers], [], [], timeout)
        line = self.answers.readline() if ready else b""
        if line:
            return json.loads(line)
        if not ready:
            self.kill()
            return self._dead(f"the case did not finish within {timeout:g} s (HICACHE_KIT_CASE_TIMEOUT); worker killed")
        return self._dead("the case worker exited during the case")

    def _dead(self, what: str) -> dict[str, Any]:
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        how = f"exit status {code}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how = f"killed by {signal.Signals(-code).name} (rc {code})"
        self.stderr.seek(0, os.SEEK_END)
        size = self.stderr.tell()
        self.stderr.seek(max(0, size - STDERR_TAIL))
        tail = self.stderr.read().decode(errors="replace").strip()
        return {"outcome": "crashed", "message": f"{what}: {how}", "stderr": tail}

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.requests.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
        self.answers.close()
        self.stderr.close()


_worker: _Worker | None = None


def run_case(item: Any, case: Any) -> dict[str, Any]:
    """Run pytest item ``item`` (a matrix test of a ``ConformanceTests`` class) with ``case`` in the worker."""
    global _worker
    if _worker is None or not _worker.alive:
        if _worker is not None:
            _worker.close()
        _worker = _Worker()
    cls = item.cls
    request = {
        "module": item.module.__name__,
        "file": item.module.__file__,
        "cls": cls.__qualname__,
        "test": item.originalname,
        "case": asdict(case),
    }
    answer = _worker.run(request, CASE_TIMEOUT)
    if answer["outcome"] in ("crashed", "lost"):
        _worker.close()
        _worker = None
    return answer


def stop_worker() -> None:
    """End the session's worker (at the end of the session)."""
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None


# ---- the worker side ----------------------------------------------------------------------------


def _import(name: str, path: str) -> Any:
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == path:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the test module {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run_one(request: dict[str, Any]) -> dict[str, Any]:
    import pytest
    import torch

    from .cases import Case
    from .cuda_context import context_lost

    module = _import(request["module"], request["file"])
    cls: Any = module
    for part in request["cls"].split("."):
        cls = getattr(cls, part)
    case = Case(**request["case"])
    test = getattr(cls(), request["test"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the kit's autouse fixture does in the parent
    answer: dict[str, Any]
    try:
        test(case)
        answer = {"outcome": "passed"}
    except pytest.skip.Exception as exc:
        answer = {"outcome": "skipped", "message": str(exc.msg)}
    except pytest.fail.Exception as exc:
        answer = {"outcome": "failed", "message": str(exc.msg)}
    except Exception as exc:  # noqa: BLE001 - an assertion or an error of the implementation: the case fails
        answer = {"outcome": "failed", "message": "".join(traceback.format_exception(exc)).rstrip()}
    finally:
        torch.set_num_threads(threads)
    lost = context_lost()
    if lost is not None:
        before = f" (the case itself: {answer['outcome']}: {answer.get('message', '')})" if answer else ""
        answer = {"outcome": "lost", "message": f"this case left the CUDA context broken: {lost}{before}"}
    return answer


def worker_main() -> None:
    """The case worker: reads requests on stdin, answers on ``HICACHE_KIT_WORKER_FD``; exits at EOF."""
    import faulthandler

    fd = KIT_WORKER_FD.read()
    if fd is None:
        raise SystemExit(f"the case worker answers on a pipe its parent names in {KIT_WORKER_FD.name}; it is unset")
    answers = os.fdopen(fd, "w", buffering=1)
    faulthandler.enable()  # a fatal signal prints the Python stack of the fault: the case's last words
    # What a case prints must not reach the protocol: stdout goes where stderr goes.
    os.dup2(2, 1)
    first = sys.stdin.readline()
    if not first:
        return
    parent = json.loads(first)["sys_path"]
    sys.path[:] = parent + [entry for entry in sys.path if entry not in parent]  # the parent's order first
    for line in sys.stdin:
        started = time.monotonic()
        try:
            answer = _run_one(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - the case could not even be set up here: say why
            answer = {"outcome": "failed", "message": "the case worker could not run the case: "
                      + "".join(traceback.format_exception(exc)).rstrip()}  # fmt: skip
        answer["seconds"] = round(time.monotonic() - started, 3)
        answers.write(json.dumps(answer) + "\n")
        if answer["outcome"] == "lost":
            return  # a broken context stays broken: the next case gets a fresh process


__all__ = ["CASE_TIMEOUT", "run_case", "stop_worker", "worker_main"]
