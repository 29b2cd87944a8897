"""The GPU gate: every check CI cannot run, in one command, with one JSON record of what it tested.

    scripts/dev gpu            (on the GPU machine; it calls this with the environment's python)

Steps, each bounded in time and logged; one failing step does not stop the others:

1. the whole test suite with ``HICACHE_TEST_DEVICE=cuda`` (conformance kits on CUDA pools);
2. the copy engine's batched path byte for byte (every layout, stream case, and its 2-D batch);
3. the stress checks (model shapes at their real strides, beside a GEMM, byte for byte);
4. ``compute-sanitizer --tool memcheck`` over the safety tests and a slice of the kit;
5. ``hicache bench --quick`` and ``hicache bench --overlap --quick``;
6. SGLang's own code on CUDA pools, where its wheels were carried (``integrations/sglang``).

It writes ``benchmarks/results/gpu-check.json`` (and copies it, with the logs, to ``$OUT`` when that
is set): the commit, the git tree hashes of ``hicache_core/`` and ``plugins/`` it ran on, the
machine and versions, and each step's status, counts, failures and duration. ``.ci/run`` warns
when the recorded trees are not HEAD's.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None


# ---- what was tested: git trees, from git or from the files as git would hash them ----------------------


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _object(kind: str, body: bytes) -> bytes:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()


def _tree_of(path: Path) -> bytes:
    """The git tree hash of a folder as it is on disk (git's object format), ignoring what .gitignore ignores."""
    entries = []
    for child in path.iterdir():
        if child.name in ("__pycache__", ".pytest_cache", "build", "dist") or child.name.endswith(".egg-info"):
            continue
        if child.is_symlink():
            entries.append((child.name, b"120000", _object("blob", os.readlink(child).encode())))
        elif child.is_dir():
            if any(True for _ in child.rglob("*") if _.is_file() and "__pycache__" not in _.parts):
                entries.append((child.name + "/", b"40000", _tree_of(child)))
        else:
            if child.suffix in (".pyc",):
                continue
            mode = b"100755" if os.access(child, os.X_OK) else b"100644"
            entries.append((child.name, mode, _object("blob", child.read_bytes())))
    body = b"".join(mode + b" " + name.rstrip("/").encode() + b"\0" + digest for name, mode, digest in sorted(entries))
    return _object("tree", body)


def trees() -> dict[str, str]:
    """Commit and tree hashes of the code under test (git's, or computed from the files with git's format)."""
    head = _git("rev-parse", "HEAD")
    out: dict[str, str] = {}
    matches = head is not None
    for folder in ("hicache_core", "plugins"):
        on_disk = _tree_of(ROOT / folder).hex()
        out[f"{folder}_tree"] = on_disk
        matches = matches and _git("rev-parse", f"HEAD:{folder}") == on_disk
    # A copy of the working tree may carry a .git that is not its HEAD (the device tool copies the session's
    # first one): name a commit only where git's trees are the ones on disk. The trees are what counts.
    out["commit"] = head if matches else "unknown: the trees on disk are not .git's HEAD here (see the tree hashes)"
    return out


# ---- the steps ----------------------------------------------------------------------------------------


_ONLY: set[str] | None = None


class _Saved(list):
    """The steps so far, written to gpu-check.json after each one: a run stopped from outside keeps its record."""

    def __init__(self, record: dict) -> None:
        super().__init__()
        self.record = record

    def append(self, step: dict) -> None:
        super().append(step)
        self.record["passed"] = False  # until every step has run
        (RESULTS / "gpu-check.json").write_text(json.dumps(self.record, indent=1))
        if OUT is not None:  # the device tool keeps $OUT of a run its limit stops (a few files: the record only)
            OUT.mkdir(parents=True, exist_ok=True)
            shutil.copy(RESULTS / "gpu-check.json", OUT / "gpu-check.json")


def run(name: str, argv: list[str], timeout: int, env: dict | None = None) -> dict:
    if _ONLY is not None and name not in _ONLY:
        return {"name": name, "passed": None, "tail": "not run (--only)"}
    started = time.time()
    log = RESULTS / f"gpu-check-{name}.log"
    print(f"\n== {name}: {' '.join(argv)} (at most {timeout} s)", flush=True)
    try:
        proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        text += f"\n[gpu-check] {name} was stopped after {timeout} s\n"
        code = 124
    except OSError as exc:
        text, code = f"[gpu-check] could not run {argv[0]}: {exc}\n", 127
    log.write_text(text)
    tail = "\n".join(text.strip().splitlines()[-15:])
    print(tail, flush=True)
    return {"name": name, "command": " ".join(argv), "exit_code": code, "passed": code == 0,
            "seconds": round(time.time() - started, 1), "log": log.name, "tail": tail}  # fmt: skip


def live(name: str) -> tuple[list[str], dict]:
    """pytest arguments and environment that write each test's outcome as it comes (``gpu/pytest_live.py``),
    and dump every thread's stack after 60 s in one test: a run its bound stops still names what failed and
    what hung (:func:`live_summary`). (Direct's worker thread, once traced here, was retired in 0.3.0.)"""
    report = RESULTS / f"gpu-check-{name}-live.txt"
    report.unlink(missing_ok=True)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "scripts" / "gpu"), os.environ.get("PYTHONPATH")) if p),
           "HICACHE_LIVE_REPORT": str(report)}  # fmt: skip
    return ["-p", "pytest_live", "-o", "faulthandler_timeout=60"], env


def live_summary(name: str) -> dict:
    """From the live report: the tests that failed, and those that started and never finished."""
    path = RESULTS / f"gpu-check-{name}-live.txt"
    if not path.exists():
        return {}
    started, ended, failed = set(), set(), set()
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "START":
            started.add(parts[2])
        elif len(parts) >= 4 and parts[1] in ("PASSED", "FAILED", "SKIPPED"):
            ended.add(parts[3])
            if parts[1] == "FAILED":
                failed.add(parts[3])
    return {"failed_tests": sorted(failed), "unfinished_tests": sorted(started - ended)}


def junit_counts(path: Path) -> dict:
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts["failed_tests"] = failed[:50]
    return counts


def environment() -> dict:
    import torch

    env = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda}  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "sms": props.multi_processor_count}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=driver_version,pcie.link.gen.max,pcie.link.width.max",
                            "--format=csv,noheader"], capture_output=True, text=True)  # fmt: skip
        env["driver_and_link"] = q.stdout.strip()
    return env


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def suite_step(py: str, cuda: dict):
    """The suite on CUDA pools. Workers in parallel where pytest-xdist is there: the first call of each
    kernel specialisation compiles, and compiling is what takes the time. Beside the other functional steps
    it reached 260 s at 97 % on an H100 host: bounded at 330 s, which the gate's 600 s still holds."""

    def make() -> list[dict]:
        junit = RESULTS / "gpu-check-suite.xml"
        parallel = ["-n", "8"] if _have("xdist") else []
        live_args, live_env = live("suite")
        step = run("suite", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *parallel, *live_args, "tests",
                             "plugins", f"--junitxml={junit}"], 330, cuda | live_env)  # fmt: skip
        return [step | (junit_counts(junit) or live_summary("suite"))]

    return make


def direct_steps(py: str, cuda: dict):
    """The copy engine's batched path, byte for byte, every layout and stream case; then its 2-D batch."""

    def make() -> list[dict]:
        batched = run("direct-batched", [py, "scripts/gpu/direct_check.py", "--out", str(RESULTS)], 240, cuda)
        two_d = run("direct-batch-2d", [py, "scripts/gpu/direct_check.py", "--only-2d", "--out", str(RESULTS)], 40,
                    cuda)  # fmt: skip
        return [batched, two_d]

    return make


def stress_steps(py: str):
    """Stress: model shapes at their real strides, beside a GEMM."""

    def make() -> list[dict]:
        return [
            run("stress-kernel", [py, "plugins/kernel/tests/gpu_stress.py", "--layers", "2", "--reps", "1",
                                  "--shapes", "llama-8b,deepseek-mla,dsa-indexer"], 150),  # fmt: skip
            run("stress-jit", [py, "plugins/jit/tests/gpu_check.py", "--layers", "4", "--variants", "rows",
                               "--shapes", "llama-8b,deepseek-mla"], 120),  # fmt: skip
            aliasing_step(py),
        ]

    return make


def aliasing_step(py: str) -> dict:
    """The layer loader (``scripts/gpu/layer_loads_check.py``): no deadlock with 32 consumer streams at 1, 2, 8,
    32 and the default hardware queues, and 1,000 randomized rounds with planted errors and slow submission."""
    step = run("layer-loads", [py, "scripts/gpu/layer_loads_check.py", "--aliasing", "--stress", "1000"], 330)
    text = (RESULTS / step["log"]).read_text() if "log" in step else ""
    found = re.findall(r"^SUMMARY (\{.*\})$", text, re.M)
    if found:
        summary = json.loads(found[-1])
        step["aliasing"] = summary.get("aliasing")
        step["stress"] = summary.get("stress")
        step["passed"] = step["passed"] and all(v == "ok" for v in (step["aliasing"] or {}).values()) and (
            (step["stress"] or {}).get("result") == "ok")
    else:
        step["passed"] = False
    return step


def soak_step(py: str):
    """The soak (``scripts/gpu/soak.py``): 1 TB (10**12 bytes) of random backups, loads, evictions and slot
    reuse over every layout and io backend, verification on, each loaded page compared with a reference
    independent of hicache; the counts of pages, bytes and mismatches go into the record. Beside the other functional
    steps, bounded at 300 s (the soak stops itself at 240 s, short of its bytes if it must: a failure)."""

    def make() -> list[dict]:
        out = RESULTS / "gpu-check-soak.json"
        out.unlink(missing_ok=True)  # never an earlier run's summary
        # Loads the copy can check, checked in it (HICACHE_VERIFY_IN_COPY): the others are checked apart.
        step = run("soak", [py, "scripts/gpu/soak.py", "--bytes", "1TB", "--seconds", "240", "--out", str(out)], 300,
                   {"HICACHE_VERIFY_IN_COPY": "1"})  # fmt: skip
        summary = json.loads(out.read_text()) if out.exists() else {}
        keep = ("combinations", "rounds", "pages_backed_up", "pages_loaded", "bytes_moved", "target_bytes",
                "mismatched_pages", "verification_failures", "evicted_pages", "errors", "result")  # fmt: skip
        step["soak"] = {k: summary.get(k) for k in keep}
        step["passed"] = step["passed"] and summary.get("result") == "ok"
        return [step]

    return make


def memcheck_step(py: str, cuda: dict):
    """compute-sanitizer's memcheck over the safety tests and a slice of the kit."""
    sanitizer = shutil.which("compute-sanitizer") or next(
        (str(p) for p in Path("/usr/local/cuda/bin").glob("compute-sanitizer")), None
    )

    def make() -> list[dict]:
        if _ONLY is not None and "memcheck" not in _ONLY:
            return [{"name": "memcheck", "passed": None, "tail": "not run (--only)"}]
        if not sanitizer:
            return [{"name": "memcheck", "passed": False, "tail": "compute-sanitizer not found"}]
        memcheck = [sanitizer, "--tool", "memcheck", "--error-exitcode", "3", "--target-processes", "all",
                    py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "plugins/kernel/tests/test_kernel_safety.py", "plugins/jit/tests/test_jit_safety.py",
                    "plugins/kernel/tests/test_kernel_drops.py", "plugins/jit/tests/test_jit_drops.py",
                    "plugins/direct/tests/test_conformance.py", "-k", "not page_head and (bad_input or drop or "
                    "guard or mask or mha-layer_first)"]  # fmt: skip
        step = run("memcheck", memcheck, 300, cuda)
        errors = re.findall(r"ERROR SUMMARY: (\d+) error", (RESULTS / step["log"]).read_text()) if "log" in step else []
        step["sanitizer_errors"] = sum(int(e) for e in errors) if errors else None
        return [step]

    return make


def sglang_step(cuda: dict):
    """SGLang's own code on CUDA pools, where its wheels were carried (integrations/sglang/gpu-wheels.sh).
    Its packages are installed here, before the other steps start: installing beside running tests could
    rewrite files they import."""
    if not (ROOT / "integrations" / "sglang" / "dev").exists():
        return None
    if not list((ROOT / ".whl").glob("*.whl")):
        why = "no .whl/ carried: run integrations/sglang/gpu-wheels.sh here and carry .whl"
        return lambda: [{"name": "sglang", "passed": None, "tail": why}]
    if _ONLY is None or "sglang" in _ONLY:
        subprocess.run(["bash", "integrations/sglang/dev", "gpu", "--version"], cwd=ROOT, check=False)

    def make() -> list[dict]:
        live_args, live_env = live("sglang")
        sglang = ["bash", "integrations/sglang/dev", "gpu", *(["-n", "8"] if _have("xdist") else []), *live_args]
        return [run("sglang", sglang, 170, cuda | live_env) | live_summary("sglang")]

    return make


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description="the GPU gate")
    ap.add_argument("--only", help="comma-separated step names (a partial run: it does not pass the gate)")
    global _ONLY
    args = ap.parse_args()
    _ONLY = set(args.only.split(",")) if args.only else None
    RESULTS.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    record: dict = {"what": "scripts/dev gpu: the GPU gate", **trees(), "environment": environment()}
    # Result files are named for the card that made them (the device machine lends H100s and H200s).
    gpu = re.search(r"\b([A-Z]\d{2,3})\b", record["environment"].get("gpu") or "")
    card = gpu.group(1).lower() if gpu else "gpu"
    # Every kernel is compiled from the trees named above, never taken from an earlier run's cache.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="hicache-gate-triton-")
    record["triton_cache"] = "rebuilt: an empty TRITON_CACHE_DIR for this run"
    cuda = {"HICACHE_TEST_DEVICE": "cuda", "PYTHONUNBUFFERED": "1"}
    steps = record["steps"] = _Saved(record)

    # The functional checks run side by side (the machine has 16 cores and the GPU room for all of
    # them); the benchmarks run afterwards, alone, so that nothing else shares the GPU while they time it.
    # Side by side each takes longer than alone (on the H200: direct 43 s alone, over 60 s beside the
    # others; memcheck 87 s alone, over 150 s), so the bounds leave room for that.
    functional = [suite_step(py, cuda), stress_steps(py), memcheck_step(py, cuda), sglang_step(cuda),
                  direct_steps(py, cuda), soak_step(py)]  # fmt: skip
    with ThreadPoolExecutor(max_workers=5) as pool:
        for done in as_completed([pool.submit(make) for make in functional if make is not None]):
            for step in done.result():
                steps.append(step)
    two_d = next((x for x in steps if x["name"] == "direct-batch-2d"), {})

    # The benchmarks: the quick sweep (the 2-D batch rows only if that path was byte-exact), and the overlap.
    bench_env = {"HICACHE_BENCH_BATCH_2D": "1" if two_d.get("passed") else "0"}
    steps.append(run("bench-quick", [py, "-m", "hicache_core.cli", "bench", "--quick", "--out", str(RESULTS),
                                     "--name", f"quick-{card}"], 100, bench_env))  # fmt: skip
    steps.append(run("overlap", [py, "-m", "hicache_core.cli", "bench", "--overlap", "--quick", "--out", str(RESULTS),
                                 "--name", f"overlap-{card}"], 60))  # fmt: skip
    # Host memory: a 4 GiB pool three ways, hicache's held to the bars (pinned bytes, copy speed, release).
    steps.append(run("host-memory", [py, "benchmarks/host_memory.py", "--gib", "4", "--check", "--out",
                                     str(RESULTS / f"host-memory-gate-{card}.json")], 180))  # fmt: skip
    # The copy that checks against the plain copy, per pool kind, in the shipped tiling and its best rivals so far
    # (HICACHE_VERIFY_IN_COPY stays off while these are over the 3 % bar; docs/verification.md).
    variants = "default,row-sums,programs-16,words-4096,programs-16-row-sums-words-4096"
    steps.append(run("verify-in-copy", [py, "benchmarks/verify_in_copy_variants.py", "--tokens", "4096", "--variants",
                                        variants, "--out", str(RESULTS / f"verify-in-copy-variants-{card}.json")],
                     150))  # fmt: skip
    order = ["suite", "direct-batched", "direct-batch-2d", "stress-kernel", "stress-jit", "layer-loads", "soak",
             "memcheck", "bench-quick", "overlap", "verify-in-copy", "host-memory", "sglang"]  # fmt: skip
    steps.sort(key=lambda x: order.index(x["name"]) if x["name"] in order else len(order))

    record["passed"] = _ONLY is None and all(s.get("passed") is not False for s in steps)
    path = RESULTS / "gpu-check.json"
    path.write_text(json.dumps(record, indent=1))
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, OUT / "gpu-check.json")
        patterns = ("gpu-check-*.log", "gpu-check-*.txt", f"*{card}*.json", f"*{card}*.png")
        logs = [p for pattern in patterns for p in sorted(RESULTS.glob(pattern))]
        subprocess.run(["tar", "czf", str(OUT / "gpu-check-files.tgz"), *[str(p.relative_to(ROOT)) for p in logs]],
                       cwd=ROOT, check=False)  # fmt: skip
    print("\n== summary")
    for s in steps:
        state = {True: "PASS", False: "FAIL", None: "n/a "}[s.get("passed")]
        print(f"{s['name']:<16} {state} {s.get('seconds', '-')} s  tests {s.get('tests', '-')} "
              f"failures {s.get('failures', '-')} errors {s.get('errors', '-')}")  # fmt: skip
    print(f"trees: hicache_core {record['hicache_core_tree']}, plugins {record['plugins_tree']}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
