"""The ``hicache`` command: plugins, matrix, explain, demo, bench, settings.

Exit codes: 0 the command did what was asked (a check passed, a combination resolved, a size fits); 1 it ran
and the answer is no, or the thing asked about failed (a check failed, a store could not be reached, a size
does not fit); 2 bad usage (an option's value, a file, a name or a ``HICACHE_*`` setting it does not take).
Every error is one line on stderr naming what was wrong; a report the command exists to print goes to stdout.
``hicache --version`` prints hicache-core's version. Output piped into a reader that stops early (``| head``)
ends the command quietly, with 141, the status a shell gives a process that SIGPIPE ended.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .plugins.dispatch import UnsupportedCombinationError, resolve
from .plugins.implementation import OPERATIONS, TransferRequest
from .plugins.registry import Registry, get_registry
from .plugins.versions import core_version, served_note
from .settings import SettingError
from .tools import arguments as arg
from .tools.shapes import SHAPES, shape_for_kind

#: The exit status of a command whose reader closed its output early (128 + SIGPIPE, as a shell reports it).
EXIT_PIPE_CLOSED = 141


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line: what was wrong, and where the help is (exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The command's parser: every subcommand and its options (tests walk it to reach each one)."""
    parser = _Parser(prog="hicache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hicache-core {core_version()}")
    parser.add_argument("--traceback", action="store_true",
                        help="an internal error shows its Python traceback (for a bug report)")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="installed plugins, their layouts, implementations and errors")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("matrix", help="which implementation serves each pool kind x layout x operation x io backend")
    p.add_argument("--pool", help="one registered pool kind (default: all)")
    _request_flags(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("explain", help="resolve one combination and say why")
    p.add_argument("--pool", required=True, help="a registered pool kind (hicache plugins lists them)")
    p.add_argument("--layout", required=True)
    p.add_argument("--op", required=True, choices=OPERATIONS)
    p.add_argument("--io-backend", required=True, help="an io backend (hicache plugins lists them), or auto")
    _request_flags(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("demo", help="back up, evict and reload model-shaped pools, checked against the reference")
    p.add_argument("--device", type=arg.device, help="cpu, cuda or cuda:N (default: cuda when present, else cpu)")
    p.add_argument("--tokens", type=arg.positive_int,
                   help="tokens per transfer (default: 4096 on CUDA, 256 on CPU; --storage: 512)")  # fmt: skip
    p.add_argument("--storage", metavar="URL", help="L3 demo across two processes through this store (file:///dir)")
    p.add_argument(
        "--writer-stays",
        action="store_true",
        help="with --storage: process 1 stays alive until process 2 is done (peer://: pages live with it)",
    )

    p = sub.add_parser("bench", help="the sweep: implementations on model-like pools, against the copy ceiling (GPU)")
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and the plot")
    p.add_argument("--quick", action="store_true", help="a short sweep (smoke test)")
    p.add_argument("--only", type=arg.name_list, help="comma-separated implementation names to include")
    p.add_argument("--device", choices=("cuda", "cpu"), help="cpu: the CPU implementations against memcpy")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="layer-wise loads under prefill GEMMs, backups under decode (hicache_core.tools.bench.overlap)",
    )
    p.add_argument(
        "--overlap-mode",
        type=arg.name_list,
        help="with --overlap, comma-separated: sglang (every layer's load issued before "
        "the forward, as SGLang does), loader (the same order through hicache's layer loader, as SGLang's "
        "adapter runs it), interleaved (each layer's load, then its GEMMs); default: sglang and loader "
        "with --quick, else all three",
    )
    p.add_argument("--tokens", type=arg.int_list,
                   help="comma-separated tokens per call (default: 64,4096 quick, else 64,512,4096,32768)")  # fmt: skip
    p.add_argument("--shapes", type=arg.name_list,
                   help="comma-separated shape names (default: all; quick: deepseek-mla,llama-8b)")  # fmt: skip
    p.add_argument("--name", help="file name of the JSON and PNG (default: quick, sweep or overlap)")
    p.add_argument("--layouts", type=arg.name_list, help="comma-separated layouts (default: every registered layout)")
    p.add_argument(
        "--anchor-module",
        help="module with sgl-kernel's transfer_kv_* functions to time beside hicache "
        "(default: $HICACHE_BENCH_ANCHOR, else sgl_kernel.kvcacheio; skipped where it does not import)",
    )
    p.add_argument("--storage", metavar="URL", help="benchmark L3 backup and prefetch through this store instead")
    p.add_argument("--storage-tokens", type=arg.int_list, default="4096,32768",
                   help="prefix lengths for --storage (tokens, multiples of 64)")  # fmt: skip
    p.add_argument(
        "--storage-verify",
        action="store_true",
        help="--storage with a verifying host pool (its L3 pages are checked on the device after load)",
    )

    p = sub.add_parser("calibrate", help="measure the implementations on this GPU and write the profile auto uses")
    p.add_argument("--shapes", type=arg.name_list, default="llama-8b,deepseek-mla", help="comma-separated shape names")
    p.add_argument("--tokens", type=arg.int_list, default="64,512,4096,32768",
                   help="bucket edges to measure (tokens per call)")  # fmt: skip
    p.add_argument("--layouts", type=arg.name_list,
                   help="comma-separated layouts (default: every layout two implementations claim)")  # fmt: skip
    p.add_argument("--page-size", type=arg.positive_int, default=64)
    p.add_argument("--quick", action="store_true", help="fewer repeats and SM budgets")
    p.add_argument("--out", help="profile file (default: the per-device file in the user's cache directory)")

    p = sub.add_parser("stats", help="hicache's metrics (transfers, host pool, L3 hits and misses by reason)")
    p.add_argument("snapshots", nargs="*", help="snapshot files or folders (default $HICACHE_METRICS_DIR)")
    p.add_argument("--json", action="store_true")
    from .tools.explain_miss import add_arguments as explain_miss_arguments

    explain_miss_arguments(sub.add_parser("explain-miss", help="which pages of a prefix the store holds, and why "
                                          "the rest would miss (reason codes)"))  # fmt: skip
    p = sub.add_parser("storage", help="L3 storage: check a live store, or print its statistics")
    storage_sub = p.add_subparsers(dest="storage_command", required=True)
    q = storage_sub.add_parser("check", help="write, find, read back and compare a few pages, then remove them")
    q.add_argument("url")
    q.add_argument("--json", action="store_true")
    q = storage_sub.add_parser("stats", help="the store's own figures as JSON")
    q.add_argument("url")

    p = sub.add_parser("size", help="what the host tier of a server will hold and pin, from the model's config.json")
    p.add_argument("--config", required=True, help="the model's config.json, or the folder that holds it")
    p.add_argument("--tp", type=arg.positive_int, default=1, help="tensor-parallel size (figures are per rank)")
    p.add_argument("--ranks-per-host", type=arg.positive_int,
                   help="ranks that build host pools on this machine (default: --tp)")  # fmt: skip
    p.add_argument("--layout", default="page_first", help="host layout (SGLang's --hicache-mem-layout)")
    p.add_argument("--page-size", type=arg.positive_int, default=64)
    p.add_argument("--kv-dtype", default="auto", help="KV cache dtype (auto: the model's torch_dtype)")
    p.add_argument("--hicache-size", type=arg.non_negative_number, default=0.0,
                   help="host pool GB (SGLang's --hicache-size)")  # fmt: skip
    p.add_argument("--hicache-ratio", type=arg.positive_number, default=2.0,
                   help="host/device ratio when --hicache-size is 0")  # fmt: skip
    p.add_argument("--device-tokens", type=arg.positive_int, help="the device pool's tokens (with --hicache-ratio)")
    p.add_argument("--mamba-slots", type=arg.positive_int,
                   help="a hybrid model's device Mamba slots (with --hicache-ratio)")  # fmt: skip
    p.add_argument("--prefix-tokens", type=arg.positive_int, default=4096, help="prefix length for 'prefixes held'")
    p.add_argument("--device", choices=("cuda", "cpu"), help="pinned (cuda) or not (default: cuda where present)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("settings", help="every HICACHE_* variable: its value, where it came from, what it takes")
    p.add_argument("--json", action="store_true")
    for name, command in sub.choices.items():
        command.set_defaults(parser=command)
        if name == "storage":
            for nested in storage_sub.choices.values():
                nested.set_defaults(parser=nested)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command (``argv``: its arguments, default ``sys.argv[1:]``) and return its exit status.

    0: done; 1: the answer is no, or what was asked about failed; 2: bad usage (see the module docstring). It
    does not raise, not even ``SystemExit`` for ``--help``: a bug is one ``internal error`` line and 1, unless
    ``--traceback`` was given.
    """
    output = _Output(sys.stdout)
    with contextlib.redirect_stdout(output):
        return _main(build_parser(), argv, output)


class _Output:
    """``sys.stdout`` while a command runs: it notes a write or flush that found the reader gone, so that a
    ``BrokenPipeError`` of our output is told from one of a store's socket (a failure, not a reader's choice)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.reader_gone = True
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.reader_gone = True
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _main(parser: argparse.ArgumentParser, argv: Sequence[str] | None, output: _Output) -> int:
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version, or a usage error argparse has already printed
            output.flush()
            return _exit_code(exc)
    except BrokenPipeError:
        return _output_closed(output)
    prog = args.parser.prog
    try:
        code = _run(args)
        output.flush()  # here, so that a reader gone early is seen here
        return code
    except SystemExit as exc:  # a usage error found after parsing (args.parser.error)
        return _exit_code(exc)
    except SettingError as exc:  # a HICACHE_* variable holds a value its setting does not take
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and output.reader_gone:
            return _output_closed(output)
        if args.traceback:
            raise
        if _out_of_memory(exc):  # what was asked needs more memory than there is: a failure, not a bug
            print(f"{prog}: out of memory: {_one_line(exc)}", file=sys.stderr)
            return 1
        # A bug, not bad input: still one line, saying how to get the traceback for a report.
        print(f"{prog}: internal error: {type(exc).__name__}: {_one_line(exc)} (hicache --traceback "
              f"{args.command} ... shows where; please report it)", file=sys.stderr)  # fmt: skip
        return 1


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation failed: Python's, or torch's (CUDA: OutOfMemoryError; CPU: a RuntimeError saying so)."""
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _output_closed(output: _Output) -> int:
    """The reader of our stdout went away (``hicache plugins | head -1``): stop quietly.

    Python would print a BrokenPipeError when it flushes stdout at exit; pointing stdout at /dev/null first
    leaves it nothing to complain about (the recipe of the Python docs, "Note on SIGPIPE").
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, output.stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (a test's capture): nothing will flush into a pipe
        pass
    return EXIT_PIPE_CLOSED


def _run(args: argparse.Namespace) -> int:
    usage = args.parser.error
    if args.command == "settings":
        from .tools.settings_list import run as run_settings

        return run_settings(args.json)
    if args.command == "size":
        return cmd_size(args)
    if args.command == "plugins":
        return cmd_plugins(get_registry(), args.json)
    if args.command == "matrix":
        return cmd_matrix(get_registry(), args)
    if args.command == "explain":
        return cmd_explain(get_registry(), args)
    if args.command == "stats":
        from .tools.stats import run_stats as run_metrics

        return run_metrics(args.snapshots, args.json)
    if args.command == "explain-miss":
        from .tools.explain_miss import run as run_explain_miss

        return run_explain_miss(args)
    if args.command == "storage":
        from .tools.storage_check import run_check, run_stats

        return run_check(args.url, args.json) if args.storage_command == "check" else run_stats(args.url)
    if args.command in ("demo", "bench", "calibrate"):
        _check_settings()  # they print as they go: a setting they would refuse midway is refused first
    if args.command == "demo":
        return cmd_demo(args, usage)
    if args.command == "calibrate":
        _check_names(args, usage)
        _check_out_file(args.out, usage)
        from .tools.calibrate import run_calibrate

        return run_calibrate(shapes=list(args.shapes), tokens=args.tokens, layouts=list(args.layouts or ()) or None,
                             page_size=args.page_size, quick=args.quick, out=args.out)  # fmt: skip
    return cmd_bench(args, usage)


def _check_settings() -> None:
    """Read every declared ``HICACHE_*`` setting: :class:`SettingError` for the first value one refuses."""
    from .settings.registry import declared

    for entry in declared().values():
        entry.setting.read()


def cmd_demo(args: argparse.Namespace, usage) -> int:
    if args.storage is not None:
        scheme = _check_storage_url("--storage", args.storage, usage)
        if not get_registry().storage_backends[scheme].capabilities.shared:
            usage(f"argument --storage: {scheme}:// is seen by one process only; the demo's two processes need a "
                  "shared store (file:///dir, redis://...)")  # fmt: skip
    elif args.writer_stays:
        usage("argument --writer-stays: only with --storage")
    device_type = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).partition(":")[0]
    if args.storage is not None:
        from .tools.storage_demo import PAGE as page_size
    else:
        from .tools.demo import PAGE_SIZE

        page_size = PAGE_SIZE[device_type]
    if args.tokens is not None and args.tokens % page_size:
        usage(f"argument --tokens: takes a multiple of the demo's page size, {page_size} "
              f"({'--storage' if args.storage is not None else device_type}), got {args.tokens}")  # fmt: skip
    if args.tokens is not None and 4 * args.tokens > 2**31 - 1:
        usage(f"argument --tokens: the demo's pools hold 4 x --tokens slots, addressed by int32 indices: "
              f"at most {(2**31 - 1) // 4 // page_size * page_size}, got {args.tokens}")  # fmt: skip
    problem = _missing_device(args.device)
    if problem:
        print(f"hicache demo: {problem}", file=sys.stderr)
        return 1
    if args.storage is not None:
        from .tools.storage_demo import run_storage_demo

        return run_storage_demo(args.storage, device=args.device, tokens=args.tokens or 512,
                                writer_stays=args.writer_stays)  # fmt: skip
    from .tools.demo import run_demo

    return run_demo(device=args.device, tokens=args.tokens)


def cmd_bench(args: argparse.Namespace, usage) -> int:
    _check_names(args, usage)
    if args.only:
        problem = arg.unknown_names("--only", args.only, get_registry().implementations, "implementation")
        if problem:
            usage(problem)
    if args.overlap_mode:
        from .tools.bench.overlap import MODES

        problem = arg.unknown_names("--overlap-mode", args.overlap_mode, MODES, "mode")
        if problem:
            usage(problem)
    if args.name is not None and (not args.name.strip() or set("/\0") & set(args.name) or args.name in (".", "..")):
        usage(f"argument --name: takes a file name (no folder), got {args.name!r}")
    if not args.out.strip() or "\0" in args.out or (os.path.exists(args.out) and not os.path.isdir(args.out)):
        usage(f"argument --out: takes a folder (made if missing), got {args.out!r}")
    only = ",".join(args.only) if args.only else None
    if args.storage is not None:
        _check_storage_url("--storage", args.storage, usage)
        from .tools.bench.storage import PAGE, run_storage_bench

        odd = [t for t in args.storage_tokens if t % PAGE]
        if odd:
            usage(f"argument --storage-tokens: takes multiples of {PAGE} (the page size), got {odd[0]}")
        return run_storage_bench(args.storage, out=args.out, tokens=list(args.storage_tokens),
                                 verify=args.storage_verify)  # fmt: skip
    if args.device == "cpu":
        from .tools.bench.cpu import run_cpu_bench

        return run_cpu_bench(out=args.out, quick=args.quick)
    if args.overlap:
        from .tools.bench.overlap_command import run_overlap

        return run_overlap(out=args.out, quick=args.quick, only=only, name=args.name, modes=args.overlap_mode,
                           layouts=args.layouts)  # fmt: skip
    from .tools.bench.sweep import run_bench

    return run_bench(out=args.out, quick=args.quick, only=only, name=args.name, tokens=args.tokens,
                     shapes=args.shapes, layouts=args.layouts, anchor_module=args.anchor_module)  # fmt: skip


def _check_names(args: argparse.Namespace, usage) -> None:
    """``--shapes`` and ``--layouts`` name shapes and registered layouts (bench, calibrate)."""
    problem = arg.unknown_names("--shapes", args.shapes, SHAPES, "shape") or arg.unknown_names(
        "--layouts", args.layouts, get_registry().layouts, "layout"
    )
    if problem:
        usage(problem)


def _check_out_file(path: str | None, usage) -> None:
    if path is not None and (not path.strip() or "\0" in path or os.path.isdir(path)):
        usage(f"argument --out: takes a file path, got {path!r}")


def _check_storage_url(option: str, url: str, usage) -> str:
    """The scheme of a URL an installed storage backend serves; else a usage error (nothing is opened here)."""
    from .storage.make import UnknownStorageScheme, check_url
    from .storage.url import redact_url

    try:
        return check_url(url).scheme
    except UnknownStorageScheme as exc:
        usage(f"argument {option}: {str(exc).splitlines()[0]} Installed: {', '.join(_schemes())}")
    except ValueError as exc:
        usage(f"argument {option}: {redact_url(str(exc))}")
    raise AssertionError("usage() exits")


def _schemes() -> list[str]:
    return [f"{s}://" for s in sorted(get_registry().storage_backends)]


def _missing_device(device: str | None) -> str | None:
    """Why ``device`` (cpu, cuda or cuda:N; ``None``: the default) is not on this machine, or ``None``."""
    if device is None or not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return f"--device {device}: no CUDA device is available here (--device cpu runs on the CPU)"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def cmd_size(args) -> int:
    from .tools.sizing import load_config, size_host_tier

    try:
        report = size_host_tier(load_config(args.config), tp_size=args.tp, layout=args.layout,
                                page_size=args.page_size, kv_dtype=args.kv_dtype, hicache_size_gb=args.hicache_size,
                                hicache_ratio=args.hicache_ratio, device_tokens=args.device_tokens,
                                mamba_slots=args.mamba_slots, prefix_tokens=args.prefix_tokens,
                                device=_device(args), ranks_per_host=args.ranks_per_host)  # fmt: skip
    except SettingError:
        raise
    except OSError as exc:  # the config cannot be read: missing, a folder without config.json, no permission
        print(f"hicache size: error: --config {args.config!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # includes a path with a NUL byte
        print(f"hicache size: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_json(), indent=2) if args.json else report.text())
    if report.refusal is not None:
        print(f"hicache size: does not fit: {_one_line(report.refusal)}", file=sys.stderr)
        return 1
    return 0


def _request_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sharded", action="store_true", help="a layer-sharded pool (this rank owns half the layers)")
    p.add_argument("--draft", action="store_true", help="a pool with an MTP draft layer")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), help="device type (default: cuda where a GPU is present, else cpu)"
    )
    p.add_argument("--page-size", type=arg.positive_int, default=64)
    p.add_argument("--no-pin", action="store_true", help="host memory not pinned")


def _device(args) -> str:
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _request(registry: Registry, args, pool: str, layout: str, op: str, io_backend: str) -> TransferRequest:
    device = _device(args)
    geometry = shape_for_kind(pool).geometry(
        page_size=args.page_size, device_type=device, sharded=args.sharded, draft=args.draft
    )
    # Host memory is pinned only where CUDA is: a CPU pool's host memory never is.
    pinned = device == "cuda" and not args.no_pin
    return TransferRequest(io_backend, op, geometry, registry.layouts[layout], pinned)


def _check_pool(registry: Registry, pool: str | None) -> str | None:
    if pool is not None and pool not in registry.pool_kinds:
        kinds = ", ".join(sorted(registry.pool_kinds))
        return f"argument --pool: unknown pool kind {pool!r}; registered pool kinds: {kinds}"
    return None


def cmd_plugins(registry: Registry, as_json: bool) -> int:
    records = []
    for record in registry.plugins.values():
        data = record.as_dict()
        data["implementations"] = [_impl_dict(registry, name) for name in record.implementations]
        records.append(data)
    if as_json:
        print(json.dumps(records, indent=2))
        return 0
    print(f"hicache-core {core_version()} (plugin API {'.'.join(core_version().split('.')[:2])})")
    for data in records:
        version = f" {data['version']}" if data["version"] else ""
        print(f"{data['name']} ({data['distribution'] or 'no distribution'}{version}): {data['status']}")
        if data["requires"] is not None:
            note = served_note(data["requires"], core_version())
            verdict = ("compatible" if data["compatible"] else "INCOMPATIBLE") + (f" ({note})" if note else "")
            print(f"    requires hicache-core {data['requires'] or '(any version)'}: {verdict}")
        for kind in data["pool_kinds"]:
            print(f"    pool kind {kind}")
        for layout in data["layouts"]:
            print(f"    layout {layout}")
        for impl in data["implementations"]:
            print(
                f"    implementation {impl['name']}: io backend {impl['io_backend']!r}, priority {impl['priority']}, "
                f"devices {','.join(impl['device_types'])}"
            )
        for err in data["errors"]:
            print(f"    error: {err}")
    return 0


def _impl_dict(registry: Registry, name: str) -> dict:
    impl = registry.implementations[name]
    return {
        "name": name,
        "io_backend": impl.io_backend,
        "priority": impl.priority,
        "description": impl.description,
        "pool_kinds": sorted(impl.pool_kinds) if impl.pool_kinds is not None else "any",
        "layouts": sorted(impl.layouts) if impl.layouts is not None else "any",
        "operations": sorted(impl.operations),
        "device_types": sorted(impl.device_types),
        "sharded": impl.sharded,
        "draft": impl.draft,
        "item_alignment": impl.item_alignment,
        "index_device": impl.index_device,
        "index_dtypes": sorted(str(d).replace("torch.", "") for d in impl.index_dtypes),
        "needs_pinned_host": impl.needs_pinned_host,
    }


def cmd_matrix(registry: Registry, args) -> int:
    problem = _check_pool(registry, args.pool)
    if problem:
        args.parser.error(problem)
    pools = [args.pool] if args.pool else list(registry.pool_kinds)
    backends = [b for b in registry.io_backends() if b != "reference"]
    rows = []
    for pool in pools:
        for layout in sorted(registry.layouts):
            if not _request(registry, args, pool, layout, OPERATIONS[0], "reference").storable:
                continue
            for op in OPERATIONS:
                cells = {}
                for backend in backends:
                    request = _request(registry, args, pool, layout, op, backend)
                    cells[backend] = _try_resolve(registry, request)
                rows.append({"pool": pool, "layout": layout, "operation": op, "io_backends": cells})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ["pool", "layout", *backends]
    table = []
    for i in range(0, len(rows), len(OPERATIONS)):
        group = rows[i : i + len(OPERATIONS)]
        table.append([group[0]["pool"], group[0]["layout"], *[_cell(group, b) for b in backends]])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    flags = ", ".join(f for f in ("sharded" if args.sharded else "", "draft" if args.draft else "") if f)
    print(f"device {_device(args)}, page size {args.page_size}{', ' + flags if flags else ''}")
    print("cell: the implementation serving all three operations, else load/backup all/backup layer each")
    for line in [header, [("-" * w) for w in widths], *table]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())
    return 0


def _cell(group: list[dict], backend: str) -> str:
    names = [r["io_backends"][backend] or "-" for r in group]
    return names[0] if len(set(names)) == 1 else " / ".join(names)


def _try_resolve(registry: Registry, request: TransferRequest) -> str | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return resolve(registry, request).name
        except (UnsupportedCombinationError, ValueError):
            return None


def cmd_explain(registry: Registry, args) -> int:
    problem = _check_pool(registry, args.pool)
    if problem is None and args.layout not in registry.layouts:
        problem = f"argument --layout: unknown layout {args.layout!r}; layouts: {', '.join(sorted(registry.layouts))}"
    if problem:
        args.parser.error(problem)
    request = _request(registry, args, args.pool, args.layout, args.op, args.io_backend)
    try:
        impl = resolve(registry, request)
    except UnsupportedCombinationError as exc:
        code = _explain_out(args.json, {"resolved": False, "error": str(exc)}, str(exc))
        head = str(exc).splitlines()[0].rstrip(":").removesuffix(" with")
        print(f"hicache explain: {head} (the reasons are on stdout)", file=sys.stderr)
        return code
    plugin = registry.plugin_of(impl.name)
    head = f"Resolved to {impl.name} (plugin {plugin}, io backend {impl.io_backend!r}, priority {impl.priority})"
    lines = [head + " for:"]
    lines += [f"    {label:<12} {value}" for label, value in request.describe()]
    if impl.description:
        lines.append(f"  How it moves bytes: {impl.description}")
    data = {"resolved": True, "implementation": impl.name, "plugin": plugin, "description": impl.description}
    if args.io_backend == "auto":
        from .plugins import autoselect

        table = autoselect.choices(registry, request)
        if table:
            path = autoselect.profile_path() if request.device_type == "cuda" and _has_gpu() else None
            where = f"profile {path}" if path is not None and path.exists() else "no profile for this device"
            lines[0] = f"auto chooses per call by tokens per call ({where}; else the static rule) for:"
            lines += ["  Per token-count bucket:"] + autoselect.explain_lines(registry, request)
            data["buckets"] = {str(e): {"implementation": c.implementation, "max_ctas": c.max_ctas,
                                        "plugin": registry.plugin_of(c.implementation),
                                        "source": c.source, "why": c.why} for e, c in table.items()}  # fmt: skip
            # The choice for the largest calls (where most bytes move); "buckets" has every choice.
            data["implementation"] = table[max(table)].implementation
            data["plugin"] = registry.plugin_of(data["implementation"])  # the chosen one's, not the first claimant's
        else:
            lines.append(f"  auto on {request.device_type} pools: the best-priority claimant (the rule is about GPUs)")
    return _explain_out(args.json, data, "\n".join(lines))


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _explain_out(as_json: bool, data: dict, text: str) -> int:
    print(json.dumps(data, indent=2) if as_json else text)
    return 0 if data["resolved"] else 1


if __name__ == "__main__":
    sys.exit(main())
