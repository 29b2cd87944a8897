"""Pins for SGLang: ``POST /hicache/pin_prefix``, ``/hicache/unpin_prefix`` and ``/hicache/prefetch``.

SGLang merged a TTL pin API (``POST /hicache/pin_prefix``, ``{token_ids, ttl_seconds}``, sglang#18941),
which Dynamo's ``nvext.cache_control`` calls on a worker after a request, then reverted it (#21884)
before 0.5.23. This module gives a hicache-served SGLang 0.5.23 that front door, in upstream's shape,
over hicache's leases (:mod:`hicache_core.retention`): each scheduler hashes ``token_ids`` into SGLang's
own L3 keys and leases them in every hicache store it has bound (:class:`~hicache_sglang.storage.HicacheStorage`:
the L3 tier, or the peer tier where that is the store). SGLang's own GPU and host tiers stay SGLang's.

The route from the HTTP process to the schedulers is SGLang's own control plane, the one its
``/flush_cache`` and ``/hicache/storage-backend`` take: a request struct the tokenizer manager fans
out to every DP rank through a ``FanOutCommunicator`` (an entry in ``tokenizer_control_mixin``'s
``_COMMUNICATOR_SPECS``, which also sets its fan-out when DP workers change), the scheduler's
``_request_dispatcher`` (one more entry after ``init_request_dispatcher``) and ``send_control_output``
back. The structs are SGLang IPC structs (``BaseReq``), registered with ``io_struct.hook_custom_types``
so SGLang's msgpack decoder takes them. Not ``RpcReqInput``: its parameters are flat scalars (no token
list), ``handle_rpc_request`` drops the method's return value, and its answer goes to the offline
engine's RPC socket, which the HTTP server does not have. The tokens are hashed in the scheduler, with
SGLang's ``get_storage_hash_str`` on a ``RadixKey`` built as the scheduler builds a request's (page
aligned, ``extra_key`` with the LoRA id appended, ``cache_salt``, EAGLE's bigram keys) at the radix
tree's page size: the keys its cache controller writes. The TP ranks of a DP group answer together
(gathered over SGLang's ``dp_tp`` CPU group, in step, as every rank handles the same control request).

The routes are added to ``sglang.srt.entrypoints.http_server.app`` as that module is imported (it makes
the app at import; :func:`install` runs before it, in SGLang's plugin loader), with SGLang's
``ADMIN_OPTIONAL`` auth level, as its other ``/hicache`` endpoints.

A pin's lease fields (``priority``, ``session``, ``supersede``, and ``ttl_seconds`` as the hints' ``ttl``,
or Anthropic's ``cache_control``) are read by :func:`hicache_core.retention.hints.hints_from_mapping`, as
every server's adapter reads them; every field is checked in the HTTP process before a scheduler sees it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import logging
import sys
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from sglang.srt.managers.io_struct import BaseReq

from hicache_core.retention import Retain
from hicache_core.retention.hints import hints_from_mapping
from hicache_core.retention.lease import CACHE_CONTROL_PRIORITY

from .errors import NotServedError

log = logging.getLogger("hicache_sglang")
HTTP_MODULE = "sglang.srt.entrypoints.http_server"
ROUTES = {"/hicache/pin_prefix": "pin", "/hicache/unpin_prefix": "unpin", "/hicache/prefetch": "prefetch"}
COMMUNICATOR = "hicache_retention"
_KEYS = ("extra_key", "cache_salt", "lora_path")
FIELDS = {
    "pin": ("token_ids", "ttl_seconds", "cache_control", "priority", "session", "supersede", *_KEYS),
    "unpin": ("session", "token_ids", *_KEYS),
    "prefetch": ("token_ids", *_KEYS),
}
#: How many pins of each store ``unpin_prefix`` by ``token_ids`` can find (the latest; older ones still end).
REMEMBERED_PINS = 1 << 16
_TOKEN_MAX = (1 << 63) - 1  # a RadixKey holds its tokens in array("q")


class HicacheRetentionReqInput(BaseReq, kw_only=True):
    """A pin, unpin or prefetch for every scheduler (checked by :func:`parse` in the HTTP process)."""

    action: str
    token_ids: list[int] | None = None
    ttl_seconds: float = 0.0
    priority: int = CACHE_CONTROL_PRIORITY
    session: str | None = None
    supersede: bool = False
    extra_key: str | None = None  # with the LoRA id appended, as SGLang's Req has it
    cache_salt: str | None = None


class HicacheRetentionReqOutput(BaseReq, kw_only=True):
    """One DP group's answer: a refusal (nothing touched), store failures, and one record per store."""

    refused: str = ""
    failed: str = ""
    stores: list[dict[str, Any]] = []


class Refused(ValueError):
    """The request cannot be served as asked; nothing was touched (HTTP 400)."""


# ---- the HTTP process: a request's body, checked before anything happens ------------------------------


def parse(action: str, body: Any) -> HicacheRetentionReqInput:
    """The request ``body`` (decoded JSON) of ``action`` (``pin``, ``unpin``, ``prefetch``), every field checked.

    ``lora_path`` is resolved later (:func:`resolve_lora`); raises :class:`Refused` naming the field.
    """
    if action not in FIELDS:
        raise ValueError(f"unknown action {action!r}; one of {', '.join(FIELDS)}")
    path = next(p for p, a in ROUTES.items() if a == action)
    if not isinstance(body, dict):
        raise Refused(f"{path} takes a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(FIELDS[action]))
    if unknown:
        raise Refused(f"{path} does not take {', '.join(map(repr, unknown))}; it takes {', '.join(FIELDS[action])}")
    req = HicacheRetentionReqInput(action=action)
    if action == "unpin":
        if ("session" in body) == ("token_ids" in body):
            raise Refused(f'{path} takes "session" (every pin of a session) or "token_ids" (the pins of a prefix), '
                          "one of them")  # fmt: skip
        if "session" in body:
            if set(body) != {"session"}:
                raise Refused(f'{path} with "session" takes no other field')
            req.session = _session(body["session"])
            return req
    elif "token_ids" not in body:
        raise Refused(f'{path} needs "token_ids"')
    req.token_ids = _tokens(body["token_ids"])
    for name in ("extra_key", "cache_salt"):
        setattr(req, name, _text(body, name))
    if action == "pin":
        _pin_fields(req, body, path)
    return req


def _pin_fields(req: HicacheRetentionReqInput, body: dict, path: str) -> None:
    """A pin's lease, read by hicache's own reader of retention hints, as every server's adapter reads them."""
    if ("ttl_seconds" in body) == ("cache_control" in body):
        raise Refused(f'{path} needs "ttl_seconds" (seconds the pin lives after its last hit) or Anthropic\'s '
                      '"cache_control" ({"type": "ephemeral", "ttl": "5m"}), one of them')  # fmt: skip
    ttl = body.get("ttl_seconds")
    if "ttl_seconds" in body and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))):
        raise Refused(f"ttl_seconds is a number of seconds, got {ttl!r}")
    mapping = {k: body[k] for k in ("priority", "session", "supersede") if k in body}
    if "ttl_seconds" in body:
        mapping["ttl"] = ttl
    elif "priority" in body:  # cache_control's lease has Dynamo's priority; a second one would ask twice
        raise Refused(f'{path} takes "priority" with "ttl_seconds"; a "cache_control" pin has priority '
                      f"{CACHE_CONTROL_PRIORITY}")  # fmt: skip
    try:
        hints = hints_from_mapping(mapping, cache_control=body.get("cache_control"), where=path)
    except ValueError as exc:
        raise Refused(str(exc)) from None
    if hints.retain is None:
        raise Refused(f"{path} asks for no lease")
    req.priority, req.ttl_seconds = hints.retain.priority, hints.retain.ttl_s
    req.session, req.supersede = hints.session, hints.supersede


def resolve_lora(req: HicacheRetentionReqInput, lora_path: Any, registry: Any) -> None:
    """Append the LoRA adapter ``lora_path``'s id to ``req.extra_key``, as SGLang's ``Req`` does for its pages."""
    if lora_path is None or lora_path == "":
        return
    if not isinstance(lora_path, str):
        raise Refused(f"lora_path is the name of a loaded LoRA adapter, got {lora_path!r}")
    adapters = registry.get_all_adapters() if registry is not None else {}
    ref = adapters.get(lora_path)
    if ref is None:
        raise Refused(f"lora_path {lora_path!r} is not a loaded LoRA adapter (loaded: {sorted(adapters) or 'none'})")
    req.extra_key = (req.extra_key or "") + ref.lora_id


def retain_of(req: HicacheRetentionReqInput) -> Retain:
    """The lease a pin asks for."""
    try:
        return Retain(priority=req.priority, ttl_s=req.ttl_seconds, session=req.session)
    except ValueError as exc:
        raise Refused(str(exc)) from None


def _tokens(value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise Refused(f"token_ids is a non-empty list of token ids, got {type(value).__name__}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _TOKEN_MAX:
            raise Refused(f"token_ids[{i}] is {t!r}, not a token id (an integer >= 0)")
    return value


def _session(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise Refused(f"session is a non-empty text of at most 256 characters, got {value!r}")
    return value


def _text(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise Refused(f"{name} is a text, as in SGLang's /generate, got {value!r}")
    return value or None  # SGLang's requests take "" as none


# ---- the schedulers: SGLang's page hashes, leased in every bound store --------------------------------


def page_hashes(token_ids: Sequence[int], page_size: int, *, extra_key: str | None = None,
                cache_salt: str | None = None, is_bigram: bool = False) -> list[str]:  # fmt: skip
    """SGLang's L3 keys of the whole pages of ``token_ids``: the keys its cache controller writes for them."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    key = RadixKey(array("q", token_ids), extra_key=extra_key, is_bigram=is_bigram, cache_salt=cache_salt)
    key = key.page_aligned(page_size)
    return list(get_storage_hash_str(key, None, page_size=page_size)) if len(key) else []


_pins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> {last page hash: [lease ids]}


def run(req: HicacheRetentionReqInput, storages: Iterable[Any], *, page_size: int,
        is_bigram: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Serve ``req`` on every bound ``storages`` (:class:`~hicache_sglang.storage.HicacheStorage`); one record each.

    Everything is checked before the first store is touched (:class:`Refused`); a store that fails gets
    ``error`` in its record and the others are still served.
    """
    if req.action not in FIELDS:
        raise Refused(f"unknown action {req.action!r}")
    storages = [s for s in storages if getattr(s, "store", None) is not None]
    keys: list[str] = []
    if req.token_ids is not None:
        keys = page_hashes(req.token_ids, page_size, extra_key=req.extra_key, cache_salt=req.cache_salt,
                           is_bigram=is_bigram)  # fmt: skip
        if not keys:
            raise Refused(f"token_ids hold {len(req.token_ids)} tokens: no whole page of {page_size}")
    retain = retain_of(req) if req.action == "pin" else None
    if not storages:
        raise Refused("this server has no hicache storage bound: start it with --hicache-storage-backend dynamic "
                      "and hicache_sglang.storage's extra config (README: L3)")  # fmt: skip
    out = []
    for storage in storages:
        store, cfg = storage.store, storage.config
        record: dict[str, Any] = {"store": store.url.redacted, "tp_rank": cfg.tp_rank, "dp_rank": cfg.dp_rank}
        try:
            if req.action == "pin":
                grant = store.retain(keys, retain, supersede=req.supersede)
                _remember(store, keys[-1], grant.lease_id)
                record.update(pages=len(keys), leased=grant.pages, protected=grant.protected, capped=grant.capped,
                              eviction=grant.eviction, lease_id=grant.lease_id)  # fmt: skip
            elif req.action == "unpin":
                if req.session is not None:
                    released = store.release(session=req.session)
                else:
                    released = sum(store.release(lease_id=i) for i in _pins.get(store, {}).pop(keys[-1], ()))
                record.update(released=released)
            else:
                record.update(pages=len(keys), prefetching=store.prefetch(keys))
        except Exception as exc:  # noqa: BLE001 - reported in the answer; the other stores are still served
            log.warning("hicache %s on %s failed: %s", req.action, store.url.redacted, exc)
            record["error"] = f"{type(exc).__name__}: {exc}"
        out.append(record)
    return out


def _remember(store: Any, tail: str, lease_id: int) -> None:
    pins = _pins.setdefault(store, OrderedDict())
    pins.setdefault(tail, []).append(lease_id)
    pins.move_to_end(tail)
    while len(pins) > REMEMBERED_PINS:  # the oldest pins end by their TTL; unpin by token_ids no longer finds them
        pins.popitem(last=False)


def handle(scheduler: Any, req: HicacheRetentionReqInput) -> HicacheRetentionReqOutput:
    """The scheduler's handler (``Scheduler.handle_hicache_retention``): this rank's stores, then its DP group's."""
    from . import weight_updates

    tree = scheduler.tree_cache
    local: dict[str, Any]
    try:
        core = getattr(tree, "tree_core", None)
        local = {"stores": run(req, weight_updates.bound_storages(), page_size=getattr(tree, "page_size", None)
                               or scheduler.page_size, is_bigram=bool(getattr(core, "is_eagle", False)))}  # fmt: skip
    except Refused as exc:
        local = {"refused": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the answer says it; a scheduler never dies of a pin
        log.exception("hicache %s failed", req.action)
        local = {"failed": f"{type(exc).__name__}: {exc}"}
    parts = _gather(getattr(scheduler, "dp_tp_cpu_group", None), local)
    stores = [s for p in parts for s in p.get("stores", ())]
    failed = [p["failed"] for p in parts if p.get("failed")] + [s["error"] for s in stores if "error" in s]
    refused = next((p["refused"] for p in parts if p.get("refused")), "")
    return HicacheRetentionReqOutput(refused=refused, failed=" | ".join(dict.fromkeys(failed)), stores=stores)


def _gather(group: Any, local: dict[str, Any]) -> list[dict[str, Any]]:
    """Every TP rank's answer, on each (all of them handle the same control request, in the same order)."""
    import torch.distributed as dist

    if group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return [local]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, local, group=group)
    return out


# ---- the HTTP process: routes, and the answer summed over ranks --------------------------------------


def answer(action: str, outputs: Sequence[HicacheRetentionReqOutput]) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body for the DP groups' ``outputs``."""
    refused = next((o.refused for o in outputs if o.refused), "")
    if refused:
        return 400, {"success": False, "message": refused}
    stores = [s for o in outputs for s in o.stores]
    body: dict[str, Any] = {"success": True, "stores": stores}
    if action == "pin":
        total = {k: sum(s.get(k, 0) for s in stores) for k in ("leased", "protected", "capped")}
        body.update(pages=max((s.get("pages", 0) for s in stores), default=0), **total,
                    eviction=sorted({s["eviction"] for s in stores if "eviction" in s}))  # fmt: skip
        body["message"] = (f"{total['protected']} of {total['leased']} leased pages protected in {len(stores)} "
                           f"store(s); {total['capped']} over the retention cap")  # fmt: skip
    elif action == "unpin":
        body["released"] = sum(s.get("released", 0) for s in stores)
        body["message"] = f"{body['released']} lease(s) ended in {len(stores)} store(s)"
    else:
        body.update(pages=max((s.get("pages", 0) for s in stores), default=0),
                    prefetching=sum(s.get("prefetching", 0) for s in stores))  # fmt: skip
        body["message"] = f"{body['prefetching']} page(s) being brought up in {len(stores)} store(s)"
    failed = " | ".join(dict.fromkeys(o.failed for o in outputs if o.failed))
    if failed:
        body.update(success=False, message=f"{body['message']}; failed: {failed}")
        return 500, body
    return 200, body


def _endpoint(action: str) -> Any:
    from sglang.srt.utils.auth import AuthLevel, auth_level
    from starlette.responses import JSONResponse

    async def endpoint(request: Any) -> Any:
        http = sys.modules[HTTP_MODULE]
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            why = "is empty" if not raw.strip() else f"is not JSON ({exc})"
            return JSONResponse({"success": False, "message": f"the body {why}: POST a JSON object"}, status_code=400)
        tm = http.get_global_state().tokenizer_manager
        communicator = getattr(tm, f"{COMMUNICATOR}_communicator", None)
        if communicator is None:
            return JSONResponse({"success": False, "message": "hicache_sglang was installed after SGLang's tokenizer "
                                 "manager started: restart the server with it"}, status_code=503)  # fmt: skip
        try:
            req = parse(action, body)
            resolve_lora(req, body.get("lora_path"), getattr(tm, "lora_registry", None))
        except Refused as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        tm.auto_create_handle_loop()
        status, out = answer(action, await communicator(req))
        return JSONResponse(out, status_code=status)

    endpoint.__name__ = f"hicache_{action}"
    return auth_level(AuthLevel.ADMIN_OPTIONAL)(endpoint)


def add_routes(app: Any) -> None:
    """Add the three routes to SGLang's FastAPI ``app`` (once)."""
    have = {getattr(r, "path", None) for r in app.router.routes}
    for path, action in ROUTES.items():
        if path not in have:
            app.add_route(path, _endpoint(action), methods=["POST"], include_in_schema=False)


class _RoutesOnImport(importlib.abc.MetaPathFinder):
    """Adds the routes once SGLang's HTTP server module has run (it makes its app at import)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != HTTP_MODULE:
            return None
        sys.meta_path.remove(self)  # the real finders locate it; this one only wraps its execution
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            add_routes(module.app)

        spec.loader.exec_module = exec_module
        return spec


# ---- install -----------------------------------------------------------------------------------------

_installed: list[tuple[Any, str, Any]] = []
_finder: _RoutesOnImport | None = None


def install() -> None:
    """Give this SGLang process its part: the IPC structs, the tokenizer's communicator, the scheduler's
    handler, and the routes where the HTTP server is (idempotent)."""
    global _finder
    if _installed:
        return
    from sglang.srt.managers import io_struct, tokenizer_control_mixin
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.utils import TypeBasedDispatcher

    original = Scheduler.__dict__.get("init_request_dispatcher")
    if original is None or not hasattr(io_struct, "hook_custom_types"):
        raise NotServedError("SGLang's Scheduler.init_request_dispatcher or io_struct.hook_custom_types is missing: "
                             "this SGLang is modified; hicache's pin endpoints could not be served")  # fmt: skip
    io_struct.hook_custom_types(HicacheRetentionReqInput, HicacheRetentionReqOutput)
    specs = tokenizer_control_mixin._COMMUNICATOR_SPECS
    if all(spec[0] != COMMUNICATOR for spec in specs):
        specs.append((COMMUNICATOR, HicacheRetentionReqOutput))

    def init_request_dispatcher(self: Any) -> None:
        original(self)
        self._request_dispatcher += TypeBasedDispatcher([(HicacheRetentionReqInput, self.handle_hicache_retention)])

    init_request_dispatcher.__wrapped__ = original
    _installed.append((Scheduler, "init_request_dispatcher", original))
    _installed.append((Scheduler, "handle_hicache_retention", None))
    Scheduler.init_request_dispatcher = init_request_dispatcher
    Scheduler.handle_hicache_retention = handle
    http = sys.modules.get(HTTP_MODULE)
    if http is not None and hasattr(http, "app"):
        add_routes(http.app)
    else:
        _finder = _RoutesOnImport()
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Take the handler, the communicator and the routes out again (the IPC structs stay decodable)."""
    global _finder
    from sglang.srt.managers import tokenizer_control_mixin

    while _installed:
        owner, name, old = _installed.pop()
        if old is None:
            delattr(owner, name)
        else:
            setattr(owner, name, old)
    specs = tokenizer_control_mixin._COMMUNICATOR_SPECS
    specs[:] = [s for s in specs if s[0] != COMMUNICATOR]
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    http = sys.modules.get(HTTP_MODULE)
    if http is not None and hasattr(http, "app"):
        http.app.router.routes[:] = [r for r in http.app.router.routes if getattr(r, "path", None) not in ROUTES]


__all__ = ["HicacheRetentionReqInput", "HicacheRetentionReqOutput", "ROUTES", "Refused", "add_routes", "answer",
           "handle", "install", "page_hashes", "parse", "resolve_lora", "run", "uninstall"]  # fmt: skip
