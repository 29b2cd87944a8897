"""The core's environment variables, each declared once (:mod:`hicache_core.settings` reads them).

A light module on purpose: ``hicache settings`` and :func:`hicache_core.settings.declared` import it
without torch. The modules that use a setting import it from here and call ``.read()`` where a pool,
a store or a tool is set up. Plugins and adapters declare theirs in their own ``variables`` module,
named by a ``hicache.settings`` entry point.
"""

from __future__ import annotations

from ..key_id import MIN_KEY_BYTES, key_id_of, short_key_message
from . import Setting, SettingError, flag, integer, number, text

# ---- host pools --------------------------------------------------------------------------------------

VALIDATE = flag("HICACHE_VALIDATE", doc="1 checks indices, page structure and layer ownership on every host-pool call")
VERIFY = flag("HICACHE_VERIFY", default=None, doc="1 checks every load of every host pool against checksums taken at "
              "its backup, 0 none; unset: CUDA pools that can be verified are, CPU pools are not")  # fmt: skip
VERIFY_IN_COPY = flag("HICACHE_VERIFY_IN_COPY", default=False, doc="1: a verifying pool's Triton loads check the "
                      "pages they move in the copy's own launch (no separate check); 0 or unset: loads are checked "
                      "apart, after their last layer (the default: on an H100 the checking copy is slower than "
                      "the plain copy and a check apart, docs/verification.md)")  # fmt: skip
LOAD_TIMEOUT = number("HICACHE_LOAD_TIMEOUT_S", above=True, default=60.0, unit="seconds",
                      doc="seconds a consumer waits on the host for its layer to be submitted before it "
                          "raises")  # fmt: skip


def _node(text: str) -> int | str:
    if text in ("auto", "none"):
        return text
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


HOST_NUMA_NODE = Setting("HICACHE_HOST_NUMA_NODE", _node, "'auto', 'none' or a node number >= 0", "auto",
                         "host pools' NUMA node: auto (the GPU's own, where there are several), none, "
                         "or N")  # fmt: skip
HOST_TOUCH_THREADS = integer("HICACHE_HOST_TOUCH_THREADS", minimum=1,
                             doc="threads that first-touch a new host pool (default: the CPUs this process may "
                                 "use, at most 32)")  # fmt: skip
HOST_REGISTER_CHUNK_GIB = number("HICACHE_HOST_REGISTER_CHUNK_GIB", minimum=0, above=True, default=256.0, unit="GiB",
                                 doc="largest single cudaHostRegister call (one call fails at about "
                                     "512 GiB)")  # fmt: skip
HOST_HUGE_PAGES = flag("HICACHE_HOST_HUGE_PAGES", default=True,
                       doc="ask for transparent huge pages for host pools where the system gives them")  # fmt: skip
HOST_RESERVE_GIB = number("HICACHE_HOST_RESERVE_GIB", minimum=0, default=0.0, unit="GiB",
                          doc="host memory a new host pool must leave free (refused otherwise)")  # fmt: skip
HOST_MEMORY_CHECK = flag("HICACHE_HOST_MEMORY_CHECK", default=True,
                         doc="0 builds a host pool the memory check would refuse, with a warning (for memory the "
                             "check counts as used that the kernel will give)")  # fmt: skip

# ---- plugins, profiles, metrics ----------------------------------------------------------------------


def _plugin_names(text: str) -> frozenset[str]:
    return frozenset(name.strip() for name in text.split(",") if name.strip())


PLUGINS = Setting("HICACHE_PLUGINS", _plugin_names, "comma-separated plugin names (empty: none)", None,
                  "the hicache plugins to load (unset: every installed one; set but empty: none)",
                  keep_blank=True, show=lambda names: ",".join(sorted(names)) or "(none)")  # fmt: skip
PROFILE = text(
    "HICACHE_PROFILE",
    takes="a file path",
    doc="the calibration profile `auto` reads (default: this device's file in hicache's cache folder)",
)
METRICS_DIR = text(
    "HICACHE_METRICS_DIR",
    takes="a folder path",
    doc="where metrics snapshots and L3 outcome memories are written and `hicache stats` reads them",
)

# ---- L3 storage --------------------------------------------------------------------------------------

L3_HOST_CHECK = flag("HICACHE_L3_HOST_CHECK", doc="1 writes L3 pages checksummed on the host as well (format "
                     "algorithm 1), even where the pool verifies loads on the device")  # fmt: skip
L3_HASH_THREADS = integer(
    "HICACHE_L3_HASH_THREADS",
    minimum=1,
    doc="threads that checksum a batch's L3 pages at once (default: the cores, at most 8)",
)
# Read as text: hicache_core.storage.page_auth validates them with messages that never echo the key.
# The file's path is no secret (the file's mode guards the key); the key itself is declared secret.
L3_KEY_FILE = text("HICACHE_L3_KEY_FILE", takes="a file path",
                   doc="a file holding the cluster's L3 key: every page is written and read with a MAC")  # fmt: skip


def _key_shown(value: str) -> str:
    """The key as ``hicache settings`` shows it: its key id, which names it without revealing it.

    :raises SettingError: a key ``make_storage`` would refuse (too short), so that the listing refuses it too.
    """
    material = value.encode("utf-8", "surrogateescape").strip()  # as ClusterKey.from_environment takes it
    if len(material) < MIN_KEY_BYTES:
        raise SettingError(short_key_message("HICACHE_L3_KEY", len(material)))
    try:
        return f"<secret: key id {key_id_of(material).hex()}>"
    except ImportError:  # no blake3 to derive the id with: the length is all that may show
        return f"<secret, {len(material)} bytes>"


L3_KEY = text("HICACHE_L3_KEY", doc="the cluster's L3 key itself (prefer HICACHE_L3_KEY_FILE: the environment leaks "
              "more)", takes="a key of at least 32 bytes (openssl rand -hex 32)", secret=True,
              show=_key_shown)  # fmt: skip

# ---- KV events (hicache_core.events) ------------------------------------------------------------------

KV_EVENTS = text("HICACHE_KV_EVENTS", takes="a ZMQ address (tcp://*:5570 binds)",
                 doc="where hicache publishes the KV events of its L3 and peer tiers, in the server's format "
                     "(unset: no events)")  # fmt: skip
KV_EVENTS_REPLAY = text("HICACHE_KV_EVENTS_REPLAY", takes="a ZMQ address (tcp://*:5571)",
                        doc="the replay socket of hicache's KV events: replays, snapshots, tier statistics "
                            "(unset: none)")  # fmt: skip
KV_EVENTS_TOPIC = text("HICACHE_KV_EVENTS_TOPIC", default="", doc="the topic of hicache's KV event batches")
KV_EVENTS_AUDIT_S = number("HICACHE_KV_EVENTS_AUDIT_S", above=True, default=2.0, unit="seconds",
                           doc="seconds between two audits of what a store still holds of the pages announced "
                               "in KV events")  # fmt: skip

# ---- retention (hicache_core.retention) -------------------------------------------------------------

RETENTION_CAP = number("HICACHE_RETENTION_CAP", default=0.5,
                       doc="the share of each tier's capacity that leased pages may hold protected (0 to 1; "
                           "the rest is always left to new requests)")  # fmt: skip
LEASE_MAX_TTL_S = number("HICACHE_LEASE_MAX_TTL_S", above=True, default=86400.0, unit="seconds",
                         doc="the longest time to live a lease may ask for (a longer one is refused)")  # fmt: skip
LEASE_TOUCH_S = number("HICACHE_LEASE_TOUCH_S", above=True, default=1.0, unit="seconds",
                       doc="how often protected pages are touched in a store whose own LRU or LFU evicts "
                           "(Redis)")  # fmt: skip
LEASE_DECAY = number("HICACHE_LEASE_DECAY", default=0.5,
                     doc="after its time to live, a lease's priority decays to 0 over this fraction of the "
                         "time to live, then the lease ends")  # fmt: skip

# ---- the storage conformance kit ---------------------------------------------------------------------

KIT_ISOLATE = Setting("HICACHE_KIT_ISOLATE", {"1": True, "0": False}.__getitem__,
                      "1 (each case in a child process) or 0", None,
                      "the conformance kit runs each case in a child process (default: on CUDA)")  # fmt: skip
KIT_CASE_TIMEOUT = number(
    "HICACHE_KIT_CASE_TIMEOUT",
    above=True,
    default=600.0,
    unit="seconds",
    doc="seconds one conformance-kit case may run in its child process before it is killed",
)
KIT_WORKER_FD = integer(
    "HICACHE_KIT_WORKER_FD",
    minimum=0,
    doc="internal: the pipe a conformance-kit case worker answers on (its parent sets it)",
)

# ---- benchmarks and the GPU gate ---------------------------------------------------------------------

BENCH_ANCHOR = text("HICACHE_BENCH_ANCHOR", takes="a module name",
                    doc="the module `hicache bench` takes SGLang's copy functions from (default: "
                        "sgl_kernel.kvcacheio)")  # fmt: skip
CHECK_DEADLINE = integer(
    "HICACHE_CHECK_DEADLINE",
    minimum=1,
    doc="seconds all steps of a scripts/gpu check may take together (default: the script's)",
)
LIVE_REPORT = text(
    "HICACHE_LIVE_REPORT",
    takes="a file path",
    doc="where scripts/gpu/pytest_live.py writes each test's outcome as it comes (the GPU gate)",
)
TEST_DEVICE = text(
    "HICACHE_TEST_DEVICE",
    takes="a torch device (cpu or cuda)",
    doc="the device the test suites' pools live on (default: cpu; the GPU gate sets cuda)",
)

# ---- the scripts that build development environments ------------------------------------------------
# Read by the shell (scripts/dev, scripts/docs, integrations/*/dev): they run before hicache is installed.

DEV_VENV = text("HICACHE_VENV", takes="a folder path", doc="scripts/dev's virtual environment (default .venv)")
DEV_SGLANG_VENV = text("HICACHE_SGLANG_VENV", takes="a folder path",
                       doc="integrations/sglang/dev's environment (default .venv-sglang)")  # fmt: skip
DEV_SGLANG_SITE = text("HICACHE_SGLANG_SITE", takes="a folder path",
                       doc="integrations/sglang/dev gpu: where the offline wheels are installed")  # fmt: skip
DEV_VLLM_VENV = text("HICACHE_VLLM_VENV", takes="a folder path",
                     doc="integrations/vllm/dev's environment (default .venv-vllm)")  # fmt: skip
DEV_DOCS_VENV = text("HICACHE_DOCS_VENV", takes="a folder path", doc="scripts/docs' environment (default .venv-docs)")
DEV_TORCH_SPEC = text(
    "HICACHE_TORCH_SPEC",
    takes="a pip requirement",
    doc="the torch scripts/dev installs (default: torch==2.13.0 without a GPU, torch with one)",
)
DEV_GPU_PYTHON = text("HICACHE_GPU_PYTHON", takes="a python executable",
                      doc="scripts/dev gpu: the GPU machine's python (default python3)")  # fmt: skip
DEV_NO_APT = Setting("HICACHE_NO_APT", {"1": True, "0": False}.__getitem__, "1 or 0", False,
                     "1: scripts/dev never runs apt-get for the storage suites' system packages")  # fmt: skip

#: Every setting above, for :func:`hicache_core.settings.declared`.
SETTINGS: list[Setting] = [
    VALIDATE, VERIFY, VERIFY_IN_COPY, LOAD_TIMEOUT,
    HOST_NUMA_NODE, HOST_TOUCH_THREADS, HOST_REGISTER_CHUNK_GIB, HOST_HUGE_PAGES, HOST_RESERVE_GIB, HOST_MEMORY_CHECK,
    PLUGINS, PROFILE, METRICS_DIR,
    L3_HOST_CHECK, L3_HASH_THREADS, L3_KEY_FILE, L3_KEY,
    KV_EVENTS, KV_EVENTS_REPLAY, KV_EVENTS_TOPIC, KV_EVENTS_AUDIT_S,
    RETENTION_CAP, LEASE_MAX_TTL_S, LEASE_DECAY, LEASE_TOUCH_S,
    KIT_ISOLATE, KIT_CASE_TIMEOUT, KIT_WORKER_FD,
    BENCH_ANCHOR, CHECK_DEADLINE, LIVE_REPORT, TEST_DEVICE,
    DEV_VENV, DEV_SGLANG_VENV, DEV_SGLANG_SITE, DEV_VLLM_VENV, DEV_DOCS_VENV, DEV_TORCH_SPEC, DEV_GPU_PYTHON,
    DEV_NO_APT,
]  # fmt: skip
