"""CI's stage bookkeeping (.ci/jobs.sh): a run that ends early still says why every lane failed.

A CI run once printed only the foreground's failure and, for two background lanes, an exit status with
no reason. These run small bash scripts that source the real file, with jobs that fail, pass and hang.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ci(body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "ci.sh"
    script.write_text("set -euo pipefail\nsource .ci/jobs.sh\n" + body)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_foreground_failure_prints_the_failed_lanes_and_stops_the_running_ones(tmp_path):
    pid_file = tmp_path / "hung.pid"
    done = tmp_path / "failed.done"
    run = _ci(
        f"""
background lane-failed bash -c 'echo installing; echo "OSError: [Errno 28] No space left"; touch {done}; exit 3'
background lane-hung bash -c 'echo $$ > {pid_file}; exec sleep 300'
while [ ! -f {done} ] || [ ! -s {pid_file} ]; do sleep 0.05; done
sleep 0.3
.ci/stage core-suite bash -c 'echo "1 failed"; exit 1'
""",
        tmp_path,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout
    failed = out.index("--- background job lane-failed failed (exit status 3); the end of its log ---")
    assert out.index("OSError: [Errno 28] No space left") > failed
    assert "--- background job lane-hung: still running, stopped ---" in out
    table = out[out.index("--- stage times") :]
    assert re.search(r"free disk: [0-9.]+ GB here", table.splitlines()[0]), table
    rows = {line.split()[0]: line.split()[-1] for line in table.splitlines()[2:] if not line.startswith("total:")}
    assert rows == {"lane-failed": "3", "core-suite": "1"}, table
    hung = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{hung}").exists():
        assert time.monotonic() < deadline, "the hung lane's process outlived CI"
        time.sleep(0.05)


def test_an_awaited_failure_prints_its_whole_log_once_and_the_others_too(tmp_path):
    first, second = tmp_path / "a.done", tmp_path / "b.done"
    run = _ci(
        f"""
background lane-a bash -c 'echo "a: first line"; echo "a: the reason"; touch {first}; exit 2'
background lane-b bash -c 'echo "b: the reason"; touch {second}; exit 5'
background lane-ok bash -c 'echo "ok: fine"'
while [ ! -f {first} ] || [ ! -f {second} ]; do sleep 0.05; done
# lane-b wrote its file before it exited: what is tested is a job that has ended, so wait for its end too
while ! ended "$bg_pid_lane_b"; do sleep 0.05; done
await lane-ok
await lane-a
""",
        tmp_path,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    out = run.stdout
    assert out.count("a: the reason") == 1, out
    assert out.count("a: first line") == 1, out
    assert "--- background job lane-a (exit status 2) ---" in out
    assert "--- background job lane-b failed (exit status 5); the end of its log ---" in out
    assert out.count("b: the reason") == 1, out
    assert out.count("ok: fine") == 1, out
    assert "lane-ok failed" not in out and "lane-ok: still running" not in out
    assert "FAILED: background job lane-a exited with status 2" in run.stderr


def test_the_end_of_a_long_log_is_what_is_printed(tmp_path):
    done = tmp_path / "long.done"
    run = _ci(
        f"""
background lane-long bash -c 'for i in $(seq 1 100); do echo "line $i"; done; touch {done}; exit 1'
while [ ! -f {done} ]; do sleep 0.05; done
sleep 0.3
false
""",
        tmp_path,
    )
    assert run.returncode == 1
    lines = run.stdout.splitlines()
    start = lines.index("--- background job lane-long failed (exit status 1); the end of its log ---")
    printed = [line for line in lines[start + 1 :] if line.startswith("line ")]
    assert printed == [f"line {i}" for i in range(62, 101)], printed
