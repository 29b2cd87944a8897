"""``hicache explain-miss URL``: which pages of a prefix the store holds, and why the rest would miss.

It rebuilds, in this process, the host pool geometry the server's pages were stored under
(``--shape`` from :data:`hicache_core.tools.shapes.SHAPES`, ``--layers``, ``--page-size``,
``--layout``: the same names as ``hicache bench --shapes`` and ``hicache demo``), binds the
store's namespace (``--model-id``, ``--rank``, ``--tp-size``) and runs
:func:`hicache_core.storage.explain.explain_miss`: an existence check and a verification read
of every page into a scratch page (nothing is written or removed). The pool holds a few pages
only: a page's key and namespace do not depend on the pool's size.

What it can say from outside the server: ``in_store``, ``not_in_store``, ``checksum_failed``,
``layout_mismatch`` (stored under another layout of the same model), ``earlier_page_missing``,
``old_weight_version`` (``--weight-version`` the server's, ``--old-weight-version`` the versions
it served before: stored only under an old one's key, so never loaded), and ``in_host``
(``--host-pages``: what the caller knows its host tier holds). ``timed_out``,
``ranks_disagreed``, ``host_pool_full``, ``queue_full``, ``cancelled`` and each page's last outcome
(``loaded``, ``earlier_page_failed``) leave no trace in the store: only the controller's
memory has them. A server that wrote it (``StorageController.write_outcomes()``, by default
``$HICACHE_METRICS_DIR/hicache-outcomes-<pid>-rank<r>.json``) lets this command read it
(``--outcomes``, default ``$HICACHE_METRICS_DIR``); otherwise ask the live API,
``StorageController.explain_miss``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..metrics import metrics_dir
from ..plugins.registry import get_registry
from ..pool.host_pool import make_host_pool
from ..settings import SettingError
from ..storage.backend import StorageError
from ..storage.explain import Outcomes, explain_miss
from ..storage.url import redact_url
from .arguments import non_negative_int, positive_int
from .shapes import SHAPES
from .storage_check import open_store

WHO = "hicache explain-miss"
#: The most bytes the small pools explain-miss rebuilds may take (4 pages of the server's geometry take far less).
POOL_BYTES_MAX = 1 << 31
EPILOG = """reasons from the store: in_store, not_in_store, checksum_failed, layout_mismatch, earlier_page_missing;
in_host with --host-pages; old_weight_version with --old-weight-version. timed_out, ranks_disagreed, host_pool_full,
queue_full and cancelled (and each page's last_outcome: loaded, earlier_page_failed, ...) come only from the
controller's memory: from the files StorageController.write_outcomes() writes (--outcomes, default
$HICACHE_METRICS_DIR), or from the live API StorageController.explain_miss."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags (``hicache explain-miss``)."""

    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("url", help="the store (file:///dir, redis://host:port/db, mooncake://host:port, ...)")
    p.add_argument("--model-id", required=True, help="the model id the server passed (SGLang: the model path)")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the pool's model shape")
    p.add_argument("--layers", type=positive_int, help="host layers per page (default: the shape's)")
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--layout", default="page_first", help="the host pool layout (hicache plugins lists them)")
    p.add_argument("--rank", type=non_negative_int, default=0, help="tensor-parallel rank")
    p.add_argument("--tp-size", type=positive_int, default=1)
    p.add_argument("--weight-version", default="", help="the server's weight version (SGLang: --weight-version, "
                   "or the version of its last in-place weight update; default: unversioned)")  # fmt: skip
    p.add_argument("--old-weight-version", action="append", default=[], metavar="VERSION",
                   help="a weight version the server served before (repeatable, oldest first): a page stored only "
                   "under it is reported old_weight_version")  # fmt: skip
    tokens = p.add_mutually_exclusive_group(required=True)
    tokens.add_argument("--tokens", metavar="FILE", help="token ids: a JSON list, or ids separated by spaces, "
                        "commas or newlines ('-': stdin)")  # fmt: skip
    tokens.add_argument("--token-ids", metavar="LIST", help="token ids, comma-separated")
    p.add_argument("--host-pages", type=non_negative_int, help="leading pages the host tier holds (reported in_host)")
    p.add_argument("--outcomes", metavar="PATH", help="an outcomes file, or a folder of hicache-outcomes-*.json "
                   "(default: $HICACHE_METRICS_DIR)")  # fmt: skip
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Explain the miss; exit 0 when every page would hit, 1 when some would not, 2 on bad input or no store."""
    try:
        if not args.model_id.strip():
            raise ValueError("--model-id: takes the model id the server passed, got ''")
        if args.rank >= args.tp_size:
            raise ValueError(f"--rank {args.rank} is not a rank of --tp-size {args.tp_size} (ranks 0 to "
                             f"{args.tp_size - 1})")  # fmt: skip
        token_ids = _token_ids(args)
        pool = _pool(args)
        outcomes, broken = _outcomes(args.outcomes, args.rank)
    except SettingError:
        raise
    except (ValueError, OSError) as exc:
        print(f"{WHO}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2

    versions = [*args.old_weight_version, args.weight_version]
    backend, code = open_store(args.url, pool, who=WHO, model_id=args.model_id, tp_rank=args.rank,
                               tp_size=args.tp_size, weight_version=versions[0])  # fmt: skip
    if backend is None:
        return code
    try:
        for version in versions[1:]:  # the store remembers each earlier version, as the server's did
            backend.set_weight_version(version)
        memory = outcomes.get(backend.namespace.prefix)
        report = explain_miss(backend, token_ids, host_pages=args.host_pages, outcomes=memory, rank=args.rank,
                              broken=broken.get(backend.namespace.prefix, ""))  # fmt: skip
    except (ValueError, TypeError) as exc:
        print(f"{WHO}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except StorageError as exc:
        print(f"{WHO}: the store failed: {' '.join(redact_url(str(exc)).split())}", file=sys.stderr)
        return 1
    finally:
        backend.close()
    if args.json:
        print(json.dumps({**report.as_dict(), "outcomes_read": memory is not None}, indent=2))
    else:
        print(report.format())
        if memory is None:
            print("(no outcome memory of this namespace and rank was read: timed_out, ranks_disagreed and "
                  "host_pool_full come from StorageController.write_outcomes() files or the live API)")  # fmt: skip
    if report.hit_pages == len(report.pages):
        return 0
    print(f"{WHO}: {len(report.pages) - report.hit_pages} of {len(report.pages)} pages would miss", file=sys.stderr)
    return 1


def _token_ids(args: argparse.Namespace) -> list[int]:
    if args.token_ids is not None:
        text, where = args.token_ids, "--token-ids"
    else:
        where = f"--tokens {args.tokens!r}"
        try:
            text = sys.stdin.read() if args.tokens == "-" else Path(args.tokens).read_text()
        except UnicodeDecodeError:
            raise ValueError(f"{where}: not UTF-8 text") from None
        except (OSError, ValueError) as exc:  # missing, a folder, a path with a NUL byte
            raise ValueError(f"{where}: {getattr(exc, 'strerror', None) or exc}") from None
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{where}: not a JSON list of token ids ({exc})") from None
    else:
        values = text.replace(",", " ").split()
    ids = []
    for v in values:
        if isinstance(v, str) and v.lstrip("-").isdigit():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{where}: token ids are non-negative integers, got {v!r}")
        ids.append(v)
    if not ids:
        raise ValueError(f"{where}: no token ids")
    return ids


def _pool(args: argparse.Namespace) -> Any:
    """A small CPU host pool of the server's geometry (a page's key and namespace do not depend on its size)."""

    if args.layout not in get_registry().layouts:
        raise ValueError(f"unknown layout {args.layout!r}; layouts: {', '.join(sorted(get_registry().layouts))}")
    tokens = 4 * args.page_size
    shape = SHAPES[args.shape]
    need = 2 * tokens * shape.item_bytes() * (args.layers or shape.layers)  # the device pool and the host pool
    if need > POOL_BYTES_MAX:
        raise ValueError(f"--page-size {args.page_size} and --layers {args.layers or shape.layers}: the pools this "
                         f"rebuilds (4 pages) would take {need} bytes; it allows {POOL_BYTES_MAX}")  # fmt: skip
    dev = SHAPES[args.shape].device_pool(tokens, page_size=args.page_size, device="cpu", layers=args.layers)
    return make_host_pool(dev, layout=args.layout, io_backend="auto", size=tokens)


def _outcomes(path: str | None, rank: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Namespace prefix -> the merged outcome memory of ``rank`` (newest entry of a key wins), and broken notes."""

    source = path or metrics_dir()
    if not source:
        return {}, {}
    p = Path(source)
    if p.is_dir():
        files = sorted(p.glob("hicache-outcomes-*.json"))
    elif p.is_file():
        files = [p]
    elif path:
        raise ValueError(f"--outcomes {path}: neither an outcomes file nor a folder of them")
    else:
        return {}, {}
    merged: dict[str, Any] = {}
    broken: dict[str, str] = {}
    for f in files:
        memory, tags = Outcomes.read(f)
        if tags["rank"] != rank:
            continue
        into = merged.setdefault(tags["namespace"], Outcomes(1 << 20))
        for key, entry in memory._last.items():
            have = into._last.get(key)
            if have is None or have[2] <= entry[2]:
                into._last[key] = entry
        if tags["broken"]:
            broken[tags["namespace"]] = tags["broken"]
    return merged, broken
