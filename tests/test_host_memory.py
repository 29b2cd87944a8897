"""Host memory: exact sizes, release, refusals before any byte, NUMA placement, the metric.

Sizes are held to an oracle written from SGLang's host pool shapes (``2 * size * layers * heads * dim`` for
MHA, ``size * layers * 576`` for MLA...), and to the kernel's own view of the process's mappings
(``/proc/self/maps``), not to the declarations under test.
"""

from __future__ import annotations

import gc
import mmap
import time

import pytest
import torch

import hicache_core as hc
from hicache_core import host_memory as hm
from hicache_core import metrics
from hicache_core.host_memory import numa
from hicache_core.host_memory.limits import MemoryLimits
from hicache_core.settings import SettingError

PAGE = mmap.PAGESIZE


def _maps() -> list[tuple[int, int]]:
    """``(start, end)`` of every mapping of this process, as the kernel lists them (adjacent ones may be merged)."""
    out = []
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        out.append((lo, hi))
    return out


def _covered(address: int, length: int = 1) -> bool:
    """Whether ``[address, address + length)`` is mapped in this process (touching mappings taken as one)."""
    spans: list[list[int]] = []
    for lo, hi in sorted(_maps()):
        if spans and lo == spans[-1][1]:
            spans[-1][1] = hi
        else:
            spans.append([lo, hi])
    return any(lo <= address and address + length <= hi for lo, hi in spans)


def _pinned_metric() -> dict[str, float]:
    return {v["labels"]["pool"]: v["value"] for v in metrics.snapshot()["hicache_host_pinned_bytes"]["values"]}


def _mha(tokens=1024, page=16, layers=4, heads=8, dim=64):
    return hc.MHADevicePool(size=tokens, page_size=page, dtype=torch.bfloat16, head_num=heads, head_dim=dim,
                            layer_num=layers, device="cpu")  # fmt: skip


def _mla(tokens=1024, page=16, layers=3):
    return hc.MLADevicePool(size=tokens, page_size=page, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
                            layer_num=layers, device="cpu")  # fmt: skip


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_an_mha_pool_maps_exactly_the_bytes_sglang_shapes_hold(layout):
    host = hc.make_host_pool(_mha(), layout=layout, io_backend="auto", size=3000)
    size = 3008  # whole pages of 16
    asked = 2 * size * 4 * 8 * 64 * 2  # K and V, tokens, layers, heads, head_dim, bf16
    assert host.size == size and host.host_memory.asked == asked
    assert host.host_memory.mapped == -(-asked // PAGE) * PAGE
    start = host.kv_buffer.data_ptr()
    assert _covered(start, host.host_memory.mapped)  # the kernel maps every byte of it
    assert host.kv_buffer.untyped_storage().nbytes() == host.host_memory.mapped
    assert torch.count_nonzero(host.kv_buffer) == 0  # first-touched with zeros


def test_an_mla_split_pool_maps_each_part_at_its_size():
    host = hc.make_host_pool(_mla(), layout="page_first_kv_split", io_backend="auto", size=2048)
    sizes = {name: asked for name, asked, _ in host.host_memory.buffers}
    assert sizes == {"k_buffer": 2048 * 3 * 512 * 2, "v_buffer": 2048 * 3 * 64 * 2}
    assert host.k_buffer.shape == (128, 3, 16, 1, 512) and host.v_buffer.shape == (128, 3, 16, 1, 64)


def test_a_destroyed_pool_leaves_no_mapping_behind():
    host = hc.make_host_pool(_mha(), layout="page_first", io_backend="auto")
    label, start, length = host.label, host.kv_buffer.data_ptr(), host.host_memory.mapped
    assert _covered(start, length)
    assert any(r.label.startswith(label) for r in hm.live_records())
    host.destroy()
    gc.collect()
    assert not _covered(start) and not _covered(start + length - 1)
    assert not any(r.label.startswith(label) for r in hm.live_records())


def test_a_view_the_caller_kept_keeps_its_memory_until_it_goes():
    host = hc.make_host_pool(_mha(), layout="page_first", io_backend="auto")
    start = host.kv_buffer.data_ptr()
    kept = host.kv_buffer[0, :16]
    kept.fill_(7)
    host.destroy()
    gc.collect()
    assert _covered(start) and float(kept[0, 0, 0, 0]) == 7.0
    del kept
    gc.collect()
    assert not _covered(start)


def test_a_pool_over_the_reserve_is_refused_before_any_byte(monkeypatch):
    monkeypatch.setenv("HICACHE_HOST_RESERVE_GIB", "100000")
    records = len(hm.live_records())
    with pytest.raises(hm.HostMemoryError) as err:
        hc.make_host_pool(_mha(), layout="page_first", io_backend="auto", label="the test's pool")
    text = str(err.value)
    assert "the test's pool would not fit: it needs 16777216 bytes" in text
    assert "HICACHE_HOST_RESERVE_GIB" in text and "MemAvailable" in text and "Nothing was allocated" in text
    assert err.value.needed == 2 * 2048 * 4 * 8 * 64 * 2 + 100000 * (1 << 30)
    assert len(hm.live_records()) == records
    assert not any(r.label.startswith("the test's pool") for r in hm.live_records())


def test_a_pool_larger_than_the_machine_is_refused_naming_its_bytes():
    tokens = 2 * hm.read_limits().available // (2 * 4 * 8 * 64 * 2)  # twice what is free: no race with others
    with pytest.raises(hm.HostMemoryError) as err:
        hc.make_host_pool(_mha(), layout="layer_first", io_backend="auto", size=tokens)
    assert "would not fit" in str(err.value) and "--hicache-size" in str(err.value)
    assert err.value.needed > err.value.limit


def test_the_cgroup_limit_binds_when_it_is_tighter():
    plan = hm.plan_host_memory({"kv": 3 << 30}, label="pool", pinned=True)
    limits = MemoryLimits(available=64 << 30, total=128 << 30, cgroup_limit=8 << 30, cgroup_usage=6 << 30,
                          cgroup_path="/sys/fs/cgroup/server", memlock=None)  # fmt: skip
    with pytest.raises(hm.HostMemoryError) as err:
        hm.check_fits(plan, limits)
    assert err.value.limit == 2 << 30
    assert "the cgroup's limit (/sys/fs/cgroup/server: 8589934592 bytes, 6442450944 used)" in str(err.value)
    assert "3221225472 bytes (3.00 GiB, pinned)" in str(err.value)
    hm.check_fits(plan, MemoryLimits(64 << 30, 128 << 30, None, None, None, None))


def test_rdma_registration_is_held_to_the_locked_memory_limit():
    limits = MemoryLimits(64 << 30, 128 << 30, None, None, None, memlock=64 << 10)
    with pytest.raises(hm.HostMemoryError) as err:
        hm.check_lockable(1 << 20, "peer:// staging", limits)
    assert "RLIMIT_MEMLOCK, 65536 bytes" in str(err.value) and "ulimit -l unlimited" in str(err.value)
    hm.check_lockable(1 << 20, "peer:// staging", MemoryLimits(64 << 30, 128 << 30, None, None, None, None))


def test_pages_are_placed_on_the_node_asked(monkeypatch):
    node = numa.online_nodes()[0]
    monkeypatch.setenv("HICACHE_HOST_NUMA_NODE", str(node))
    host = hc.make_host_pool(_mha(), layout="page_first", io_backend="auto")
    assert host.host_memory.node == node
    assert f"node {node} (HICACHE_HOST_NUMA_NODE={node})" in host.host_memory.node_reason
    buffer = host.kv_buffer
    assert numa.nodes_of(buffer.data_ptr(), buffer.numel() * buffer.element_size()) == {node: 64}


def test_a_node_the_machine_lacks_and_a_bad_setting_are_refused(monkeypatch):
    monkeypatch.setenv("HICACHE_HOST_NUMA_NODE", "4095")
    with pytest.raises(ValueError, match="HICACHE_HOST_NUMA_NODE=4095: this machine's nodes with memory are"):
        hc.make_host_pool(_mha(), layout="page_first", io_backend="auto")
    monkeypatch.setenv("HICACHE_HOST_NUMA_NODE", "near")
    with pytest.raises(SettingError, match="HICACHE_HOST_NUMA_NODE='near' is not 'auto', 'none' or a node number"):
        hc.make_host_pool(_mha(), layout="page_first", io_backend="auto")


def test_one_node_is_said_to_need_no_placement(monkeypatch):
    monkeypatch.delenv("HICACHE_HOST_NUMA_NODE", raising=False)
    if len(numa.online_nodes()) != 1:
        pytest.skip("this machine has several NUMA nodes")
    node, why = hm.choose_node(torch.device("cpu"))
    assert node is None and why == f"one node ({numa.online_nodes()[0]}) on this machine: nothing to place"


def test_touch_threads_fill_every_page(monkeypatch):
    monkeypatch.setenv("HICACHE_HOST_TOUCH_THREADS", "3")
    t = hm.host_tensor((5 * PAGE + 8,), torch.uint8, label="t", name="staging", pinned=False, fill=9)
    assert t.shape == (5 * PAGE + 8,) and int(t.min()) == 9 == int(t.max())


def test_pinned_bytes_are_counted_per_pool_where_cuda_pins():
    if not torch.cuda.is_available():
        host = hc.make_host_pool(_mha(), layout="page_first", io_backend="auto", label="a CPU pool")
        assert "a CPU pool" not in _pinned_metric()
        assert not host.host_memory.pinned and host.host_memory.pinned_bytes == 0
        return
    dev = hc.MHADevicePool(size=1024, page_size=16, dtype=torch.bfloat16, head_num=8, head_dim=64, layer_num=4,
                           device="cuda")  # fmt: skip
    host = hc.make_host_pool(dev, layout="page_first", io_backend="auto", label="a CUDA pool")
    assert host.kv_buffer.is_pinned() and host.host_memory.pinned_bytes == host.host_memory.mapped
    assert _pinned_metric()["a CUDA pool"] >= host.host_memory.mapped
    host.destroy()
    gc.collect()
    assert "a CUDA pool" not in _pinned_metric()


def test_a_node_the_kernel_refuses_is_said_so_before_any_pool():
    assert numa.placement_refused(numa.online_nodes()[0]) is None
    assert numa.placement_refused(4095) == "mbind was refused: mbind(node 4095): Invalid argument"


def _in_fork(report) -> dict:
    """``report()`` (a JSON-able dict) in a child made by os.fork(); what it returned, or how it died."""
    import json
    import os

    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 0
        try:
            os.write(writer, json.dumps(report()).encode())
        except BaseException:  # noqa: BLE001 - the exit status says so
            code = 1
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child ended with {os.waitstatus_to_exitcode(status)}"
    return json.loads(text)


def _mapped_in_this_process(address: int, length: int) -> list[dict]:
    """Every mapping of this process that overlaps the range: its permissions and resident kB (``/proc/self/smaps``)."""
    out: list[dict] = []
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 2 and not fields[0].endswith(":"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            current = {"perms": fields[1], "rss_kb": 0} if lo < address + length and address < hi else None
            if current is not None:
                out.append(current)
        elif fields[0] == "Rss:" and out and current is not None:
            current["rss_kb"] += int(fields[1])
    return out


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # Python 3.12+ warns of fork beside threads
def test_a_forked_child_gets_no_copy_of_a_host_mapping_and_the_parents_bytes_stay():
    buffer = hm.host_tensor((16 << 20,), torch.uint8, label="fork test", name="buffer", pinned=False, fill=0x5A)
    address, length = buffer.data_ptr(), buffer.numel()
    assert [r.dontfork for r in hm.live_records() if r.label == "fork test: buffer"] == [True]
    assert all(m["rss_kb"] > 0 for m in _mapped_in_this_process(address, length))  # the parent's pages exist

    def report() -> dict:
        return {"mapped": _mapped_in_this_process(address, length),
                "records": [r.label for r in hm.live_records() if r.label.startswith("fork test")]}  # fmt: skip

    child = _in_fork(report)
    # The range is held by an inaccessible placeholder (or nothing): the child neither has nor can read the pages.
    assert all(m["perms"].startswith("---") and m["rss_kb"] == 0 for m in child["mapped"]), child
    assert child["records"] == [], "the child counts memory it does not hold"
    assert bool((buffer == 0x5A).all()) and buffer.numel() == 16 << 20


def _fake_cgroup(tmp_path, monkeypatch, version: int, *, limit: int, usage: int, inactive: int, active: int) -> None:
    """This process's cgroup, as ``hicache_core.host_memory.limits`` reads it, made of files under ``tmp_path``."""
    from hicache_core.host_memory import limits

    root = tmp_path / "cgroup"
    if version == 2:
        folder, line = root / "pod", "0::/pod\n"
        files = {"memory.max": limit, "memory.current": usage}
        stat = f"anon {usage - inactive - active}\nfile {inactive + active}\nactive_file {active}\ninactive_file " \
               f"{inactive}\n"  # fmt: skip
    else:
        folder, line = root / "memory" / "pod", "4:memory:/pod\n"
        files = {"memory.limit_in_bytes": limit, "memory.usage_in_bytes": usage}
        stat = f"cache {inactive + active}\ninactive_file 0\nactive_file 0\ntotal_active_file {active}\n" \
               f"total_inactive_file {inactive}\n"  # fmt: skip
    folder.mkdir(parents=True)
    for name, value in files.items():
        (folder / name).write_text(f"{value}\n")
    (folder / "memory.stat").write_text(stat)
    (tmp_path / "proc-self-cgroup").write_text(line)
    monkeypatch.setattr(limits, "_CGROUP_ROOT", root)
    monkeypatch.setattr(limits, "_PROC_CGROUP", tmp_path / "proc-self-cgroup")


@pytest.mark.parametrize("version", [2, 1])
def test_a_containers_reclaimable_file_cache_is_not_counted_as_used(version, tmp_path, monkeypatch, caplog):
    mib = 1 << 20
    # 900 MiB used of 1 GiB, 700 MiB of it the weights just read (inactive file cache), 100 MiB active file cache.
    _fake_cgroup(tmp_path, monkeypatch, version, limit=1024 * mib, usage=900 * mib, inactive=700 * mib,
                 active=100 * mib)  # fmt: skip
    monkeypatch.delenv("HICACHE_HOST_MEMORY_CHECK", raising=False)
    hm.check_fits(hm.plan_host_memory({"kv": 256 * mib}, label="pool", pinned=True))  # 124 MiB free counting cache
    assert hm.read_limits().cgroup_free == 824 * mib, "only inactive file cache is reclaimable; active is in use"
    with pytest.raises(hm.HostMemoryError) as err:
        hm.check_fits(hm.plan_host_memory({"kv": 900 * mib}, label="pool", pinned=True))
    assert err.value.limit == 824 * mib
    assert f"{900 * mib} used, {700 * mib} of it reclaimable file cache" in str(err.value)
    assert "HICACHE_HOST_MEMORY_CHECK=0 builds the pool anyway" in str(err.value)
    monkeypatch.setenv("HICACHE_HOST_MEMORY_CHECK", "0")
    with caplog.at_level("WARNING", logger="hicache"):
        hm.check_fits(hm.plan_host_memory({"kv": 900 * mib}, label="pool", pinned=True))
    assert "pool would not fit" in caplog.text and "built all the same (HICACHE_HOST_MEMORY_CHECK=0)" in caplog.text


_RANK = r"""
import sys
from pathlib import Path

from hicache_core.host_memory import HostMemoryError, limits, plan_host_memory, reservations

root, proc, ledger, mib, wait_s = sys.argv[1:6]
limits._CGROUP_ROOT, limits._PROC_CGROUP, reservations.LEDGER = Path(root), Path(proc), Path(ledger)
plan = plan_host_memory({"kv": int(mib) << 20}, label="a rank's pool", pinned=False)
print("ready", flush=True)
sys.stdin.readline()  # every rank is told to go at once
try:
    reservation = reservations.reserve(plan, wait_s=float(wait_s))
except HostMemoryError as exc:
    print("refused", str(exc).replace("\n", " "), flush=True)
    sys.exit(0)
print("reserved", flush=True)
sys.stdin.readline()  # held until told, or killed
reservation.release()
"""


def test_ranks_that_reserve_at_once_cannot_overcommit_the_host_and_a_killed_ones_reservation_ends(
        tmp_path, monkeypatch):  # fmt: skip
    import os
    import signal
    import subprocess
    import sys

    from hicache_core.host_memory import limits, reservations

    mib = 1 << 20
    _fake_cgroup(tmp_path, monkeypatch, 2, limit=1000 * mib, usage=0, inactive=0, active=0)
    monkeypatch.setattr(reservations, "LEDGER", tmp_path / "ledger")
    env = {k: v for k, v in os.environ.items() if k not in ("HICACHE_HOST_RESERVE_GIB", "HICACHE_HOST_MEMORY_CHECK")}
    monkeypatch.delenv("HICACHE_HOST_RESERVE_GIB", raising=False)
    monkeypatch.delenv("HICACHE_HOST_MEMORY_CHECK", raising=False)
    argv = [sys.executable, "-c", _RANK, str(limits._CGROUP_ROOT), str(limits._PROC_CGROUP), str(tmp_path / "ledger"),
            "400", "1.0"]  # fmt: skip
    ranks = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for _ in "abc"]
    try:
        for rank in ranks:
            assert rank.stdout.readline().strip() == "ready"
        for rank in ranks:  # each passes check_fits on its own: 400 of 1000 MiB
            rank.stdin.write("go\n")
            rank.stdin.flush()
        said = {rank.pid: rank.stdout.readline().strip() for rank in ranks}
        holders = [rank for rank in ranks if said[rank.pid] == "reserved"]
        refused = [said[rank.pid] for rank in ranks if said[rank.pid].startswith("refused")]
        assert len(holders) == 2 and len(refused) == 1, said
        assert "processes building host pools on this host reserved 838860800 bytes of it" in refused[0]
        assert all(f"pid {h.pid} (a rank's pool: 419430400 bytes)" in refused[0] for h in holders), refused[0]

        plan = hm.plan_host_memory({"kv": 400 * mib}, label="after the kill", pinned=False)
        with pytest.raises(hm.HostMemoryError):
            reservations.reserve(plan, wait_s=0)  # 600 MiB of 1000 are still reserved by two live ranks
        os.kill(holders[0].pid, signal.SIGKILL)
        holders[0].wait()
        with reservations.reserve(plan, wait_s=0) as mine:
            lines = (tmp_path / "ledger").read_text().splitlines()
            assert sorted(int(line.split()[0]) for line in lines) == sorted([holders[1].pid, os.getpid()])
        assert mine.left == 0 and str(os.getpid()) not in (tmp_path / "ledger").read_text()

        # A pool checks its plan again as it is mapped, beside the reservation of the rank still holding one.
        monkeypatch.setattr(reservations, "WAIT_S", 0.3)
        hm.check_fits(hm.plan_host_memory({"kv": 700 * mib}, label="pool", pinned=False))  # on its own, it fits
        with pytest.raises(hm.HostMemoryError) as err:
            hm.host_tensor((700 * mib,), torch.uint8, label="the late rank's pool", name="kv", pinned=False)
        assert f"pid {holders[1].pid} (a rank's pool: 419430400 bytes)" in str(err.value)
        assert not any(r.label.startswith("the late rank's pool") for r in hm.live_records())
        small = hm.host_tensor((100 * mib,), torch.uint8, label="a pool that fits", name="kv", pinned=False)
        assert small.numel() == 100 * mib and str(os.getpid()) not in (tmp_path / "ledger").read_text()

        # One that fits what is free but not beside others' reservations waits for them, rather than refusing.
        import threading

        got: list = []
        waiter = threading.Thread(target=lambda: got.append(reservations.reserve(
            hm.plan_host_memory({"kv": 700 * mib}, label="a waiting pool", pinned=False), wait_s=60)))  # fmt: skip
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive(), "it did not wait for the rank still holding its reservation"
        holders[1].stdin.write("release\n")
        holders[1].stdin.flush()
        waiter.join(30)
        assert got and got[0].left == 700 * mib
        got[0].release()
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait()
