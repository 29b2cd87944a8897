"""``io_backend="auto"``: which implementation serves each operation, per token-count bucket.

A host pool made with io backend ``"auto"`` asks :func:`choices` once per operation.
The answer comes from a measured per-device profile (written by ``hicache calibrate``,
see :mod:`hicache_core.tools.calibrate`) when it holds an entry for the pool's geometry,
layout and operation, else from :func:`static_rule`. Where different buckets get
different implementations (or settings), the pool runs an :class:`AutoChooser`, whose
per-call choice is a comparison or two against the bucket edges and a list index.

The static rule, from H200 measurements (``benchmarks/results/``, docs/performance.md):

* **Copy engine** (``direct``) wherever it claims the request and every piece it
  moves (one page of one part of one layer) is a 1-D copy of at least
  :data:`DMA_MIN_PIECE` bytes. Under a model's GEMMs the copy engine costs them
  nothing (batched copies: 0.89 / 0.92 of ideal, GEMMs about 0 % slower), while SM
  kernels cost them 5-50 % (8 CTAs: 0.88 / 0.86 of ideal). Below about 28 KiB per
  piece the copy engine falls off a cliff (4-7 GB/s for 4-24 KiB pieces on an H100,
  vLLM #42212), and 2-D pieces (MLA halves in ``page_first_kv_split``) cost one
  submission each.
* **SM kernels** otherwise (small or scattered pages, token-major and head-split
  layouts, 2-D pieces): the highest-priority kernel implementation at its default
  SM budget.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..settings.variables import PROFILE
from .dispatch import reasons_for
from .implementation import OPERATIONS, Implementation, TransferRequest

#: Upper edges (tokens per call) of the buckets; a call falls in the first edge >= its tokens,
#: and calls above the last edge in the last bucket.
BUCKETS: tuple[int, ...] = (64, 512, 4096, 32768)
#: Smallest 1-D piece (bytes) the static rule gives to the copy engine.
DMA_MIN_PIECE = 32 << 10
#: The first-party copy-engine implementation. The rule no longer reads this name: it asks each
#: candidate's declared ``engine`` (kept for 0.1 callers; docs/plugins.md, "Versions").
COPY_ENGINE = "direct.copy_engine"
ENV_PROFILE = PROFILE.name
PROFILE_VERSION = 1


def bucket_of(tokens: int) -> int:
    """The bucket edge a call of ``tokens`` tokens falls in."""
    for edge in BUCKETS:
        if tokens <= edge:
            return edge
    return BUCKETS[-1]


@dataclass(frozen=True)
class Choice:
    """What auto runs for one bucket, and why (``source`` is ``"profile"`` or ``"rule"``)."""

    implementation: str
    max_ctas: int | None = None
    source: str = "rule"
    why: str = ""

    def label(self) -> str:
        return self.implementation + (f" (max_ctas {self.max_ctas})" if self.max_ctas is not None else "")


# ---- the per-device profile ----------------------------------------------------------------------


def cache_dir() -> Path:
    """Where profiles live: ``$XDG_CACHE_HOME/hicache``, else ``~/.cache/hicache``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache"


def device_identity(index: int = 0) -> dict[str, str]:
    """GPU name, driver version and host link of CUDA device ``index`` (what a profile is keyed by)."""
    gpu, driver, link = "cpu", "none", "none"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(index)
        gpu = props.name
        driver = _driver_version()
        link = _link(props)
    return {"gpu": gpu, "driver": driver, "link": link}


def _driver_version() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        import pynvml  # nvidia-ml-py, where installed

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - the key only degrades to "unknown"
        return "unknown"


def _link(props) -> str:
    bus = getattr(props, "pci_bus_id", None)
    domain = getattr(props, "pci_domain_id", 0)
    device = getattr(props, "pci_device_id", None)
    if bus is not None and device is not None:
        path = Path(f"/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{device:02x}.0")
        try:
            speed = (path / "current_link_speed").read_text().split()[0]
            width = (path / "current_link_width").read_text().strip()
            return f"pcie-{speed}GT-x{width}"
        except OSError:
            pass
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
        return f"pcie-gen{gen}-x{width}"
    except Exception:  # noqa: BLE001
        return "unknown"


def profile_key(identity: dict[str, str]) -> str:
    """A file-name-safe key of a device identity."""
    raw = f"{identity['gpu']}-{identity['driver']}-{identity['link']}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw).strip("_")


def entry_key(request: TransferRequest) -> str:
    """The profile key of a pool geometry, layout and operation (sharding and drafts do not change it)."""
    g = request.geometry
    items = ",".join(str(b) for b in g.item_bytes)
    dtype = str(g.dtype).removeprefix("torch.")
    return f"{g.kind}|{items}|{dtype}|p{g.page_size}|{request.layout.name}|{request.operation}"


@dataclass
class Profile:
    """Measured choices for one device: ``entries[entry_key][str(bucket)]`` is a :class:`Choice` dict
    plus what was measured (``measured``: per candidate, idle and overlapped figures)."""

    device: dict[str, str]
    entries: dict[str, dict[str, dict[str, Any]]]
    version: int = PROFILE_VERSION

    def lookup(self, request: TransferRequest, bucket: int) -> Choice | None:
        entry = self.entries.get(entry_key(request), {}).get(str(bucket))
        if not entry:
            return None
        return Choice(entry["implementation"], entry.get("max_ctas"), "profile",
                      entry.get("why", "measured by hicache calibrate"))  # fmt: skip

    def record(self, request: TransferRequest, bucket: int, choice: Choice, measured: dict | None = None) -> None:
        self.entries.setdefault(entry_key(request), {})[str(bucket)] = {
            **asdict(choice), "source": "profile", "measured": measured or {}
        }  # fmt: skip

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": self.version, "device": self.device, "entries": self.entries}, indent=1))
        tmp.replace(path)  # atomic: a reader never sees half a profile
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{path}: profile version {data.get('version')!r}, expected {PROFILE_VERSION}")
        return cls(device=data["device"], entries=data.get("entries", {}))


def profile_path(identity: dict[str, str] | None = None) -> Path:
    """This device's profile file (``HICACHE_PROFILE`` overrides it)."""
    override = PROFILE.read()
    if override:
        return Path(override)
    return cache_dir() / f"profile-{profile_key(identity or device_identity())}.json"


_loaded: dict[str, Profile | None] = {}


def current_profile(device_type: str = "cuda") -> Profile | None:
    """The profile for this process's GPU, or ``None`` (loaded once per path; a bad file is ignored)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    path = profile_path()
    key = str(path)
    if key not in _loaded:
        try:
            _loaded[key] = Profile.load(path) if path.exists() else None
        except (OSError, ValueError, KeyError) as exc:
            import warnings

            warnings.warn(f"hicache: ignoring the auto profile {path}: {exc}", stacklevel=2)
            _loaded[key] = None
    return _loaded[key]


def forget_profiles() -> None:
    """Drop loaded profiles (after ``hicache calibrate`` wrote a new one, and in tests)."""
    _loaded.clear()


# ---- the static rule -----------------------------------------------------------------------------


def copy_engine_pieces(request: TransferRequest) -> tuple[int, bool]:
    """(smallest piece in bytes, whether every piece is 1-D) the copy engine would move per page."""
    spec = request.host_spec
    g = request.geometry
    it = g.itemsize
    smallest, linear = None, True
    for part in spec.parts:
        comp = g.components[part.component]
        row = (comp.heads or 1) * comp.dim * it
        item = part.heads * part.dim * it
        if item != row:
            linear = False  # a slice of each device row: a 2-D copy
        piece = item * spec.tokens_per_page
        smallest = piece if smallest is None else min(smallest, piece)
    return smallest or 0, linear


def static_rule(request: TransferRequest, candidates: list[type[Implementation]], bucket: int) -> Choice:
    """The documented rule (module docstring) among ``candidates`` (claimants, best first)."""
    names = [c.name for c in candidates]
    dma = [c.name for c in candidates if c.engine == "copy_engine"]
    if dma:
        piece, linear = copy_engine_pieces(request)
        if linear and piece >= DMA_MIN_PIECE:
            return Choice(dma[0], None, "rule",
                          f"rule: pieces of {piece // 1024} KiB (>= {DMA_MIN_PIECE // 1024} KiB, 1-D) go to the copy "
                          "engine, which leaves the SMs to the model (loads issued in SGLang's order on the H200: at "
                          "or within 3 % of the best in 6 of 8 prefill cases; where 8-CTA SM kernels beat it, in "
                          "DeepSeek-V3's transfer-bound case, they slow the GEMMs by about 54 %)")  # fmt: skip
        kernels = [c for c in candidates if c.engine != "copy_engine"]
        if kernels:
            why = (f"{piece} B pieces are under {DMA_MIN_PIECE // 1024} KiB" if linear
                   else "its pieces are 2-D (a slice of each device row)")  # fmt: skip
            return Choice(kernels[0].name, None, "rule", f"rule: {why}, so an SM kernel beats the copy engine")
        return Choice(dma[0], None, "rule", "rule: the copy engine is the only implementation that claims it")
    return Choice(names[0], None, "rule", "rule: the copy engine does not claim it; the best-priority claimant")


def choices(registry, request: TransferRequest, profile: Profile | None = None,
            use_profile: bool = True) -> dict[int, Choice]:  # fmt: skip
    """Per bucket edge, what auto runs for ``request`` (a request of io backend ``"auto"``)."""
    if request.device_type != "cuda":
        return {}  # the measurements behind the rule are GPU ones: CPU pools keep the priority order
    candidates = [c for c in registry.candidates("auto") if not reasons_for(c, request)]
    if not candidates:
        return {}
    if use_profile and profile is None:
        profile = current_profile(request.device_type)
    out = {}
    for edge in BUCKETS:
        chosen = profile.lookup(request, edge) if profile is not None else None
        if chosen is not None and chosen.implementation not in {c.name for c in candidates}:
            chosen = None  # measured with a plugin that is not installed now
        out[edge] = chosen or static_rule(request, candidates, edge)
    return out


# ---- the per-call chooser ------------------------------------------------------------------------


class AutoChooser(Implementation):
    """Several implementations behind one: each call goes to its token-count bucket's choice.

    Made per host pool by :func:`auto_class` (never registered). Indices arrive where
    :attr:`index_device` says; a choice that wants them elsewhere gets a copy, kept
    while the same tensors come back unmodified (layer after layer).
    """

    name = "auto"
    io_backend = "auto"
    index_dtypes = frozenset({torch.int32, torch.int64})
    device_types = frozenset({"cpu", "cuda"})
    table: ClassVar[tuple[tuple[int, Choice], ...]] = ()
    classes: ClassVar[dict[str, type[Implementation]]] = {}

    def __init__(self, plan) -> None:
        super().__init__(plan)
        made: dict[tuple[str, int | None], Implementation] = {}
        self.per_item = plan.geometry.page_size if plan.geometry.items_are_pages else 1
        self._entries = []
        for edge, choice in self.table:
            key = (choice.implementation, choice.max_ctas)
            impl = made.get(key)
            if impl is None:
                impl = made[key] = self.classes[choice.implementation](plan)
                if choice.max_ctas is not None and hasattr(impl, "max_ctas"):
                    impl.max_ctas = choice.max_ctas
            wants_device = type(impl).index_device == "device"
            moves = wants_device != (self.index_device == "device")
            self._entries.append((edge, impl, moves, plan.device if wants_device else torch.device("cpu")))
        self._last = self._entries[-1]
        self._moved: list = []

    def pick(self, items: int) -> Implementation:
        """The implementation a call of ``items`` items goes to."""
        return self._entry(items)[1]

    def _entry(self, items: int):
        tokens = items * self.per_item
        for entry in self._entries:
            if tokens <= entry[0]:
                return entry
        return self._last

    def _indices(self, h, d, entry):
        if not entry[2]:
            return h, d
        for key, moved in self._moved:
            if key[0] is h and key[1] is d and key[2] == h._version and key[3] == d._version and key[4] == entry[3]:
                return moved
        target = entry[3]
        moved = (h.to(target, non_blocking=True), d.to(target, non_blocking=True))
        self._moved = [((h, d, h._version, d._version, target), moved)] + self._moved[:1]
        return moved

    def load_to_device_per_layer(self, host_indices, device_indices, layer):
        entry = self._entry(host_indices.shape[0])
        h, d = self._indices(host_indices, device_indices, entry)
        entry[1].load_to_device_per_layer(h, d, layer)

    def backup_from_device_per_layer(self, host_indices, device_indices, layer):
        entry = self._entry(host_indices.shape[0])
        h, d = self._indices(host_indices, device_indices, entry)
        entry[1].backup_from_device_per_layer(h, d, layer)

    def backup_from_device_all_layer(self, host_indices, device_indices):
        entry = self._entry(host_indices.shape[0])
        h, d = self._indices(host_indices, device_indices, entry)
        entry[1].backup_from_device_all_layer(h, d)


def auto_class(registry, request: TransferRequest, resolved: type[Implementation],
               profile: Profile | None = None, use_profile: bool = True) -> type[Implementation]:  # fmt: skip
    """What a host pool of io backend ``"auto"`` runs for ``request``: ``resolved`` itself where every
    bucket chooses it at its default settings, else an :class:`AutoChooser` subclass bound to the table."""
    table = choices(registry, request, profile, use_profile)
    if not table:
        return resolved
    picked = {(c.implementation, c.max_ctas) for c in table.values()}
    if picked == {(resolved.name, None)}:
        return resolved
    if len(picked) == 1:
        name, ctas = next(iter(picked))
        if ctas is None:
            return registry.implementations[name]
    classes = {c.implementation: registry.implementations[c.implementation] for c in table.values()}
    wants_cpu = any(cls.index_device == "cpu" for cls in classes.values())
    attrs = {
        "table": tuple(sorted(table.items())),
        "classes": classes,
        "index_device": "cpu" if wants_cpu else "device",
        "operations": frozenset({request.operation}),
        "description": "auto: " + ", ".join(f"<= {e} tokens: {c.label()}" for e, c in sorted(table.items())),
    }
    return type("AutoChooser_" + request.operation, (AutoChooser,), attrs)


def explain_lines(registry, request: TransferRequest, profile: Profile | None = None) -> list[str]:
    """``hicache explain --io-backend auto``: per bucket, the implementation and why."""
    table = choices(registry, request, profile)
    if not table:
        return []
    lines = []
    lower = 0
    for edge in BUCKETS:
        c = table[edge]
        span = f"{lower + 1}-{edge} tokens" if edge != BUCKETS[-1] else f"{lower + 1}+ tokens"
        lines.append(f"    {span:<16} {c.label()}  [{c.source}] {c.why}")
        lower = edge
    return lines


__all__ = [
    "BUCKETS",
    "DMA_MIN_PIECE",
    "OPERATIONS",
    "AutoChooser",
    "Choice",
    "Profile",
    "auto_class",
    "bucket_of",
    "choices",
    "current_profile",
    "explain_lines",
    "static_rule",
]
