"""file://'s direct I/O: aligned pages go straight between the pool and the drive, every fall back is counted
and named, ``o_direct=1`` refuses a filesystem without O_DIRECT, and the bytes are the pool's either way."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

import hicache_core as hc
from hicache_core.storage import make_storage
from hicache_core.storage.backend import StorageError
from hicache_core.testing.cases import as_bytes, fill_random
from hicache_core.testing.storage_kit import slots_of

PAGE = 4


def _pool(layout: str = "layer_first", verify: bool | None = None, seed: int = 0, heads: int = 8):
    """A Llama-like host pool (heads x 128 dims, bf16): with 8 heads a page's runs are 8 KiB, 4 KiB-aligned."""
    dev = hc.MHADevicePool(PAGE * 4, PAGE, torch.bfloat16, heads, 128, 3, "cpu")
    host = hc.make_host_pool(dev, layout=layout, io_backend="reference", operations=[], size=PAGE * 12,
                             verify=verify)  # fmt: skip
    fill_random(list(host.plan.host_buffers.values()), torch.Generator().manual_seed(seed))
    return host


def _page(host, page: int) -> torch.Tensor:
    return as_bytes(host.get_data_page(page * PAGE, flat=True)).clone()


def _takes_o_direct(directory: Path) -> bool:
    probe = directory / ".probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        return False
    finally:
        if probe.exists():
            probe.unlink()
    return True


@pytest.fixture
def disk_dir(tmp_path):
    if not hasattr(os, "O_DIRECT") or not _takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    return tmp_path


@pytest.fixture
def refusing_dir(tmp_path, monkeypatch):
    """A directory whose filesystem refuses O_DIRECT with EINVAL: tmpfs before Linux 6.6 does; where /dev/shm
    takes it (newer kernels), the refusal is injected at ``open`` for paths in the directory, as such a kernel
    answers."""
    shm = Path("/dev/shm")
    directory = shm / f"hicache-test-{os.getpid()}-{tmp_path.name}"
    if not shm.is_dir() or _takes_o_direct(shm):
        directory = tmp_path / "refuses"
        real_open = os.open

        def refusing_open(path, flags, *args, **kwargs):
            if flags & os.O_DIRECT and str(path).startswith(str(directory)):
                raise OSError(errno.EINVAL, "Invalid argument", str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing_open)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


KEYS = [f"{i:064x}" for i in range(1, 7)]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("verify", [False, True])
def test_aligned_pages_go_direct_byte_exact(disk_dir, layout, verify):
    src, dst = _pool(layout, verify=verify, seed=1), _pool(layout, verify=verify, seed=2)
    url = f"file://{disk_dir}/l3?request_bytes=8192&io_depth=4"  # several requests per page, in flight together
    writer = make_storage(url, src, model_id="direct")
    reader = make_storage(url, dst, model_id="direct")
    assert all(r.ok for r in writer.write_pages(KEYS, slots_of([1, 2, 3, 4, 5, 6], PAGE)))
    results = reader.read_pages(KEYS, slots_of([7, 8, 9, 10, 11, 3], PAGE))
    assert [r.status.value for r in results] == ["ok"] * 6
    for a, b in zip([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 3]):
        assert torch.equal(_page(src, a), _page(dst, b))
    w, r = writer.get_stats().backend, reader.get_stats().backend
    assert w["direct_pages"] == {"read": 0, "write": 6} and w["buffered_pages"] == {"read": 0, "write": 0}
    assert r["direct_pages"] == {"read": 6, "write": 0} and r["direct_fallbacks"] == {}
    path = writer.backend.path_of(writer.namespace.key(KEYS[0]))
    assert path.stat().st_size == 4096 + writer.pages.page_bytes + writer.pages.trailer_bytes


def test_misaligned_pages_fall_back_counted_and_said_once(disk_dir, caplog):
    src, dst = _pool(heads=3, seed=3), _pool(heads=3, seed=4)  # runs of 3 KiB: not 4 KiB-aligned
    caplog.set_level(logging.WARNING, logger="hicache_storage_file.backend")
    store = make_storage(f"file://{disk_dir}/l3", src, model_id="mis")
    reader = make_storage(f"file://{disk_dir}/l3", dst, model_id="mis")
    assert all(r.ok for r in store.write_pages(KEYS[:3], slots_of([1, 2, 3], PAGE)))
    assert all(r.ok for r in reader.read_pages(KEYS[:3], slots_of([4, 5, 6], PAGE)))
    assert torch.equal(_page(src, 2), _page(dst, 5))
    w, r = store.get_stats().backend, reader.get_stats().backend
    assert w["direct_fallbacks"] == {"misaligned run": 3} and w["buffered_pages"]["write"] == 3
    assert r["direct_fallbacks"] == {"misaligned run": 3} and r["direct_pages"] == {"read": 0, "write": 0}
    warnings = [m.getMessage() for m in caplog.records if "fall back from direct I/O" in m.getMessage()]
    assert len(warnings) == 2, warnings  # once per backend instance and reason
    assert "misaligned run: a run of 3072 bytes" in warnings[0] and "buffered I/O" in warnings[0]


def test_o_direct_1_bounces_misaligned_pages_never_buffers(disk_dir):
    src, dst = _pool(heads=3, seed=5), _pool(heads=3, seed=6)
    store = make_storage(f"file://{disk_dir}/l3?o_direct=1", src, model_id="bounce")
    reader = make_storage(f"file://{disk_dir}/l3?o_direct=1", dst, model_id="bounce")
    assert all(r.ok for r in store.write_pages(KEYS[:2], slots_of([1, 2], PAGE)))
    assert all(r.ok for r in reader.read_pages(KEYS[:2], slots_of([3, 4], PAGE)))
    assert torch.equal(_page(src, 1), _page(dst, 3)) and torch.equal(_page(src, 2), _page(dst, 4))
    stats = reader.get_stats().backend
    assert stats["o_direct"] is True and stats["buffered_pages"] == {"read": 0, "write": 0}
    assert stats["direct_pages"]["read"] == 2 and stats["direct_fallbacks"] == {"misaligned run": 2}


def test_a_filesystem_refusing_o_direct_under_auto_falls_back_counted(refusing_dir, caplog):
    directory = refusing_dir
    caplog.set_level(logging.WARNING, logger="hicache_storage_file.backend")
    src, dst = _pool(seed=7), _pool(seed=8)
    store = make_storage(f"file://{directory}", src, model_id="tmpfs")
    assert all(r.ok for r in store.write_pages(KEYS[:2], slots_of([1, 2], PAGE)))
    reader = make_storage(f"file://{directory}", dst, model_id="tmpfs")
    assert all(r.ok for r in reader.read_pages(KEYS[:2], slots_of([3, 4], PAGE)))
    assert torch.equal(_page(src, 2), _page(dst, 4))
    w, r = store.get_stats().backend, reader.get_stats().backend
    assert w["direct_fallbacks"] == {"EINVAL from the filesystem": 2}
    assert r["direct_fallbacks"] == {"EINVAL from the filesystem": 2}
    assert w["direct_directories"] == {str(directory): "EINVAL from the filesystem"}
    said = [m.getMessage() for m in caplog.records if "refuses O_DIRECT" in m.getMessage()]
    assert said and str(directory) in said[0]
    steps = dict((s, (ok, d)) for s, ok, d in reader.backend.check_steps())
    assert "refuses O_DIRECT (EINVAL from the filesystem)" in steps[f"directory {directory}"][1]
    assert "buffered in" in steps["read path"][1]


def test_o_direct_1_on_a_filesystem_refusing_it_fails_construction_clearly(refusing_dir):
    with pytest.raises(StorageError, match=r"o_direct=1: .* \(\w+ on .*\) refuses O_DIRECT \(EINVAL from the "
                       r"filesystem\); use a directory on a disk filesystem, or o_direct=auto"):  # fmt: skip
        make_storage(f"file://{refusing_dir}?o_direct=1", _pool(), model_id="tmpfs")


def test_o_direct_0_is_buffered_with_nothing_counted(tmp_path):
    src, dst = _pool(seed=9), _pool(seed=10)
    store = make_storage(f"file://{tmp_path}/l3?o_direct=0", src, model_id="buffered")
    assert all(r.ok for r in store.write_pages(KEYS[:2], slots_of([1, 2], PAGE)))
    reader = make_storage(f"file://{tmp_path}/l3?o_direct=0", dst, model_id="buffered")
    assert all(r.ok for r in reader.read_pages(KEYS[:2], slots_of([3, 4], PAGE)))
    assert torch.equal(_page(src, 1), _page(dst, 3))
    stats = reader.get_stats().backend
    assert stats["o_direct"] is False and stats["direct_fallbacks"] == {} and stats["buffered_pages"]["read"] == 2
    (step,) = [d for s, _, d in reader.backend.check_steps() if s == "read path"]
    assert step == "buffered through the page cache (o_direct=0)"


def test_check_steps_say_the_read_path_and_gpudirect_storage(disk_dir):
    store = make_storage(f"file://{disk_dir}/l3", _pool(), model_id="check")
    steps = {s: (ok, d) for s, ok, d in store.backend.check_steps()}
    ok, detail = steps[f"directory {disk_dir}/l3"]
    assert ok and detail.endswith("takes O_DIRECT")
    read = steps["read path"][1]
    assert read.startswith("direct (O_DIRECT) straight into the host pool's pages, 16 requests of 1024 KiB")
    assert "this pool's buffers start 4 KiB-aligned" in read
    gds = steps["GPUDirect Storage"][1]
    assert gds.startswith("not used: the file:// tier reads into the host pool, never straight to the GPU;")
    if not Path("/dev/nvidia-fs0").exists():
        assert "no nvidia-fs driver" in gds


def test_a_short_file_is_a_mismatch_not_a_direct_read(disk_dir):
    src = _pool(seed=11)
    store = make_storage(f"file://{disk_dir}/l3", src, model_id="short")
    assert store.write_pages(KEYS[:1], slots_of([1], PAGE))[0].ok
    path = store.backend.path_of(store.namespace.key(KEYS[0]))
    os.truncate(path, path.stat().st_size - 4096)
    (r,) = store.read_pages(KEYS[:1], slots_of([2], PAGE))
    assert r.status.value == "mismatch" and "the page takes" in r.detail


@pytest.mark.parametrize("bad, message", [
    ("io_depth=0", "io_depth=0 must be a whole number from 1 to 256"),
    ("request_bytes=1000", "must be a multiple of 4096"),
    ("o_direct=maybe", "is not a boolean"),
    ("dirs=relative/dir", "absolute directory paths"),
])  # fmt: skip
def test_bad_options_are_refused(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        make_storage(f"file://{tmp_path}/l3?{bad}", _pool(), model_id="bad")


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_a_request_the_filesystem_refuses_later_falls_back_under_auto_and_fails_under_1(disk_dir, monkeypatch, mode):
    src, dst = _pool(seed=12), _pool(seed=13)
    writer = make_storage(f"file://{disk_dir}/l3?o_direct={mode}", src, model_id="late")
    assert all(r.ok for r in writer.write_pages(KEYS[:2], slots_of([1, 2], PAGE)))
    reader = make_storage(f"file://{disk_dir}/l3?o_direct={mode}", dst, model_id="late")
    real_preadv = os.preadv

    def refusing_preadv(fd, buffers, offset, *args):  # the probe passed; this filesystem refuses the real reads
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", refusing_preadv)
    results = reader.read_pages(KEYS[:2], slots_of([3, 4], PAGE))
    stats = reader.get_stats().backend
    if mode == "auto":
        assert all(r.ok for r in results) and torch.equal(_page(src, 2), _page(dst, 4))
        assert stats["direct_fallbacks"] == {"EINVAL from the filesystem": 2} and stats["buffered_pages"]["read"] == 2
    else:
        assert [r.status.value for r in results] == ["error", "error"]
        assert "o_direct=1: " in results[0].detail and "refused an O_DIRECT request" in results[0].detail
        assert stats["buffered_pages"]["read"] == 0
