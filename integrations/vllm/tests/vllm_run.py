"""Starting vLLM's processes from the tests: bounded in time, in their own process group, killed with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def env() -> dict[str, str]:
    return {**os.environ, **ENV}


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the whole group (vLLM's EngineCore and Worker too), then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def run_python(args: list[str], log: Path, timeout: float, extra_env: dict[str, str] | None = None) -> int:
    """Run ``python args...`` to completion (at most ``timeout`` s); its output goes to ``log``."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**env(), **(extra_env or {})},
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return -9
        finally:
            stop(proc)


def tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(text[-lines:])
