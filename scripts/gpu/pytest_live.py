"""A pytest plugin for the GPU gate: each test's outcome is written the moment it is known.

A gate step is bounded in time; when the bound stops a run, pytest's own summary (``-rf``,
junit XML) is never written, and a failure or a hang stays unnamed. With
``-p pytest_live`` (this folder on ``PYTHONPATH``) and ``HICACHE_LIVE_REPORT=<file>``, every
report (xdist workers' included) is appended to that file as it arrives, with the failure's
text, and the tests that started but did not finish can be read off it.
"""

from __future__ import annotations

import time

from hicache_core.settings.variables import LIVE_REPORT

_PATH = LIVE_REPORT.read()
_T0 = time.monotonic()


def _write(line: str) -> None:
    if _PATH:
        with open(_PATH, "a") as f:
            f.write(line.rstrip("\n") + "\n")


def pytest_runtest_logstart(nodeid, location):
    _write(f"{time.monotonic() - _T0:8.1f} START {nodeid}")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _write(f"{time.monotonic() - _T0:8.1f} {report.outcome.upper()} {report.when} {report.nodeid} "
               f"({report.duration:.1f} s)")  # fmt: skip
        if report.failed:
            _write("    " + str(report.longrepr)[-3000:].replace("\n", "\n    "))
