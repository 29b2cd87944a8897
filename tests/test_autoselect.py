"""auto: the static rule, the per-device profile (round trip, lookup), and the per-call chooser, on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

import hicache_core as hc
from hicache_core.plugins import autoselect
from hicache_core.plugins.autoselect import AutoChooser, Choice, Profile, bucket_of, choices, static_rule
from hicache_core.plugins.implementation import TransferRequest
from hicache_core.plugins.registry import Registry
from hicache_core.tools.shapes import SHAPES


def _request(registry, shape="llama-8b", layout="page_first_direct", op=hc.LOAD, page_size=64, device="cuda"):
    geometry = SHAPES[shape].geometry(page_size=page_size, device_type=device)
    return TransferRequest("auto", op, geometry, registry.layouts[layout], True)


def test_buckets():
    assert [bucket_of(n) for n in (1, 64, 65, 512, 4096, 4097, 32768, 10**6)] == [
        64, 64, 512, 512, 4096, 32768, 32768, 32768]  # fmt: skip


@pytest.mark.parametrize("shape,layout,page,expect", [
    ("llama-8b", "page_first_direct", 64, "direct.copy_engine"),  # 128 KiB pieces
    ("deepseek-mla", "layer_first", 64, "direct.copy_engine"),  # 72 KiB pieces
    ("llama-8b", "page_first_direct", 16, "direct.copy_engine"),  # 32 KiB: at the line
    ("llama-8b", "page_first_direct", 1, "kernel"),  # 2 KiB pieces: the copy engine's cliff
    ("deepseek-mla", "page_first_kv_split", 64, "kernel"),  # 2-D pieces
    ("llama-8b", "page_first", 64, "kernel"),  # token-major: direct refuses
    ("dsa-indexer", "page_first_direct", 64, "kernel"),  # 8448 B page rows
])  # fmt: skip
def test_static_rule(registry, shape, layout, page, expect):
    request = _request(registry, shape, layout, page_size=page)
    table = choices(registry, request, use_profile=False)
    names = {c.implementation for c in table.values()}
    assert len(names) == 1
    name = names.pop()
    if expect == "kernel":
        assert name in ("jit.one_layer", "kernel.triton_uva"), name
    else:
        assert name == expect
    assert all(c.source == "rule" and c.why.startswith("rule:") for c in table.values())


def test_static_rule_without_the_copy_engine_takes_the_best_priority():
    class K(hc.Implementation):
        name, io_backend, priority = "k.one", "kernel", 5

    assert static_rule(None, [K], 4096).implementation == "k.one"


def test_static_rule_reads_the_declared_engine_not_a_name(registry):
    """A third-party copy-engine implementation wins where the copy engine qualifies, as direct's does."""

    class Dma(hc.Implementation):
        name, io_backend, priority, engine = "thirdparty.dma", "dma", 1, "copy_engine"

    class Kernel(hc.Implementation):
        name, io_backend, priority = "thirdparty.kernel", "sm", 5

    big = _request(registry, "llama-8b", "page_first_direct", page_size=64)  # 128 KiB pieces
    assert static_rule(big, [Kernel, Dma], 4096).implementation == "thirdparty.dma"
    small = _request(registry, "llama-8b", "page_first_direct", page_size=1)  # 2 KiB pieces
    assert static_rule(small, [Kernel, Dma], 4096).implementation == "thirdparty.kernel"
    assert hc.Implementation.engine == "sm" and registry.implementations["direct.copy_engine"].engine == "copy_engine"


def test_cpu_pools_keep_the_priority_order(registry):
    assert choices(registry, _request(registry, device="cpu")) == {}


def test_profile_round_trip_and_lookup(tmp_path, registry):
    request = _request(registry)
    profile = Profile(device={"gpu": "NVIDIA H200", "driver": "580.1", "link": "pcie-32GT-x16"}, entries={})
    profile.record(request, 64, Choice("jit.one_layer", 8, "profile", "measured: fast"), {"jit.one_layer@8": {"s": 1}})
    profile.record(request, 4096, Choice("direct.copy_engine", None, "profile", "measured: best"))
    path = profile.save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["version"] == autoselect.PROFILE_VERSION and data["device"]["gpu"] == "NVIDIA H200"
    loaded = Profile.load(path)
    assert loaded.lookup(request, 64) == Choice("jit.one_layer", 8, "profile", "measured: fast")
    assert loaded.lookup(request, 512) is None
    table = choices(registry, request, loaded)
    assert table[64].label() == "jit.one_layer (max_ctas 8)" and table[64].source == "profile"
    assert table[512].source == "rule" and table[4096].implementation == "direct.copy_engine"
    # Another layout or operation is another entry.
    assert loaded.lookup(_request(registry, layout="layer_first"), 64) is None
    assert loaded.lookup(_request(registry, op=hc.BACKUP_ALL), 64) is None


def test_profile_of_another_version_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 99, "device": {}, "entries": {}}))
    with pytest.raises(ValueError, match="version"):
        Profile.load(path)


def test_profile_path_is_in_the_user_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(autoselect.ENV_PROFILE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = autoselect.profile_path({"gpu": "NVIDIA H200", "driver": "580.159.03", "link": "pcie-32.0GT-x16"})
    assert path == tmp_path / "hicache" / "profile-NVIDIA_H200-580.159.03-pcie-32.0GT-x16.json"
    monkeypatch.setenv(autoselect.ENV_PROFILE, str(tmp_path / "mine.json"))
    assert autoselect.profile_path() == tmp_path / "mine.json"


def test_a_profile_naming_a_missing_implementation_falls_back_to_the_rule(registry):
    request = _request(registry)
    profile = Profile(device={}, entries={})
    profile.record(request, 64, Choice("gone.impl", None))
    assert choices(registry, request, profile)[64].source == "rule"


# ---- the chooser: one call, one bucket, one implementation ---------------------------------------

calls: list[tuple[str, int, str, str]] = []


def _recorder(impl_name: str, index_device: str):
    class Recorder(hc.Implementation):
        name = impl_name
        io_backend = impl_name.split(".")[0]
        priority = 1
        device_types = frozenset({"cpu", "cuda"})
        index_dtypes = frozenset({torch.int64})

        def load_to_device_per_layer(self, h, d, layer):
            calls.append((self.name, h.numel(), h.device.type, str(getattr(self, "max_ctas", None))))

        def backup_from_device_per_layer(self, h, d, layer):
            self.load_to_device_per_layer(h, d, layer)

        def backup_from_device_all_layer(self, h, d):
            self.load_to_device_per_layer(h, d, 0)

    Recorder.index_device = index_device
    return Recorder


def test_the_chooser_routes_each_call_by_its_bucket():
    small, big = _recorder("small.k", "cpu"), _recorder("big.d", "cpu")

    class Plugin:
        @hc.hookimpl
        def hicache_register_backends(self, register):
            register(small)
            register(big)

    registry = Registry()
    registry.add_plugin(Plugin(), "fake")
    request = _request(registry)
    profile = Profile(device={}, entries={})
    profile.record(request, 64, Choice("small.k", None))
    profile.record(request, 512, Choice("small.k", None))
    cls = autoselect.auto_class(registry, request, small, profile)
    assert issubclass(cls, AutoChooser) and cls.index_device == "cpu"
    assert "<= 64 tokens: small.k" in cls.description
    dev = SHAPES["llama-8b"].device_pool(512, page_size=64, device="cpu", layers=2)
    host = hc.make_host_pool(dev, layout="page_first_direct", io_backend="reference", size=1024, operations=())
    chooser = cls(host.plan)
    calls.clear()
    for n in (64, 512, 4096, 64 * 600):
        chooser.load_to_device_per_layer(torch.arange(n), torch.arange(n), 0)
    assert [c[:2] for c in calls] == [("small.k", 64), ("small.k", 512), ("big.d", 4096), ("big.d", 38400)]
    assert chooser.pick(65).name == "small.k" and chooser.pick(513).name == "big.d"


def test_a_single_choice_at_default_settings_is_the_class_itself(registry):
    request = _request(registry)
    resolved = registry.implementations["direct.copy_engine"]
    assert autoselect.auto_class(registry, request, resolved, use_profile=False) is resolved


def test_explain_says_rule_or_profile(registry):
    lines = autoselect.explain_lines(registry, _request(registry, "deepseek-mla", "page_first_kv_split"),
                                     Profile(device={}, entries={}))  # fmt: skip
    assert len(lines) == 4 and all("[rule]" in line and "2-D" in line for line in lines)


def test_explain_auto_on_the_command_line(capsys):
    from hicache_core.cli import main

    args = ["explain", "--pool", "mha", "--layout", "page_first_direct", "--op", "load_to_device_per_layer",
            "--io-backend", "auto", "--device", "cuda"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "auto chooses per call by tokens per call" in out and "direct.copy_engine" in out and "[rule]" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["buckets"]["4096"]["implementation"] == "direct.copy_engine"
    assert data["buckets"]["64"]["source"] == "rule"
    # the chosen implementation's plugin, not the first claimant's (jit or kernel, by priority)
    assert (data["implementation"], data["plugin"]) == ("direct.copy_engine", "direct")
    assert data["buckets"]["4096"]["plugin"] == "direct"


def test_explain_says_how_the_copy_engine_submits(capsys):
    from hicache_core.cli import main

    args = ["explain", "--pool", "mha", "--layout", "page_first_direct", "--op", "load_to_device_per_layer",
            "--io-backend", "direct", "--device", "cuda"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "How it moves bytes:" in out and "cudaMemcpyBatchAsync" in out
    assert "submitted on the caller's thread and stream" in out and "worker" not in out
    assert main([*args, "--json"]) == 0
    assert "caller's thread and stream" in json.loads(capsys.readouterr().out)["description"]
