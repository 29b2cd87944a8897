"""0.2's page API on a storage backend, removed in hicache-core 0.4.0: how a backend still written for it is told.

Until 0.2 a :class:`~hicache_core.storage.StorageBackend` was also the page store: its instance
answered ``batch_exists``, ``write_pages``, ``get_stats``, ``host_pool`` ... and ``bind(host_pool,
namespace)`` tied it to a pool. 0.3 moved all of that to :class:`~hicache_core.storage.PageStore`,
which wraps the backend, and kept it on the backend for one minor version with a
``DeprecationWarning``; 0.4 removed it. A backend class that still defines one of those names, or
reads one on itself (``self.batch_exists(...)``, ``super().get_stats()``), is refused when its plugin
registers it (``StorageBackend.declaration_problems``) with :func:`page_api_problems`' message: what
changed, and how to port it. A read no scan of the class can see (another object calling
``backend.get_stats()``) fails with the same explanation (``StorageBackend.__getattr__``), and so does
a backend member read or set on what ``make_storage`` returns (``store.client``; :func:`backend_member`).
This module imports nothing of the core: the contract (``backend.py``) and the page store use it.
"""

from __future__ import annotations

import dis
import inspect
import weakref
from types import CodeType
from typing import Any

#: Each name of 0.2's page API on a backend, with what to do instead since 0.4.
PAGE_API = {
    **dict.fromkeys(
        ("batch_set_from", "batch_get_into", "write_pages", "read_pages", "set", "get", "batch_set", "batch_get",
         "batch_set_v1", "batch_get_v1"),
        "pages move through the PageStore that make_storage returns, which calls the backend's primitives "
        "(exists_objects, put_objects, get_objects_into or get_objects); a backend implements only those",
    ),
    **dict.fromkeys(
        ("batch_exists", "exists"),
        "the PageStore answers prefix queries from exists_objects, one call per batch of keys: put a native "
        "query of the store there",
    ),
    "get_stats": "statistics are the PageStore's (store.get_stats()); the store's own figures go in backend_stats()",
    "host_pool": "a backend never sees the pool: its PageStore sets namespace and page_bytes on it when it binds, "
    "and hands it the pool's memory through register_memory(spans)",
    "bind": "make_storage(url, host_pool, model_id=...) builds and binds the store "
    "(or PageStore(backend, host_pool, namespace))",
}  # fmt: skip

_CHANGE = "0.2's page API on a storage backend moved to PageStore in hicache-core 0.3.0 and left the backend in 0.4.0"
_ATTRIBUTE_LOADS = ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR")


def removed_page_api(owner: str, name: str) -> str:
    """Why ``owner.name`` (a name of 0.2's page API on a backend) is not there, and what replaces it."""
    return f'{owner}.{name}: {_CHANGE}; {PAGE_API[name]} (docs/plugins.md, "Versions")'


def page_api_problems(cls: type, base: type) -> list[str]:
    """How ``cls``, a subclass of ``base`` (the core's StorageBackend), still uses 0.2's page API (empty: it does not).

    Every class of ``cls``'s method resolution order before ``base`` is read: a name of :data:`PAGE_API`
    it defines, and one its methods read on their instance (``self.name``, ``super().name``) without
    ever setting it (an attribute the backend sets itself is its own).
    """
    cached = _FOUND.get(cls)
    if cached is None or cached[0] is not base:  # read once per class: a registry load and every PageStore ask
        cached = _FOUND[cls] = (base, tuple(_problems(cls, base)))
    return list(cached[1])


#: What :func:`page_api_problems` found, per class (weakly held: classes made in a test may go).
_FOUND: weakref.WeakKeyDictionary[type, tuple[type, tuple[str, ...]]] = weakref.WeakKeyDictionary()


def _problems(cls: type, base: type) -> list[str]:
    problems: list[str] = []
    for klass in cls.__mro__:
        if klass is base or klass is object:
            break
        defined = sorted(name for name in vars(klass) if name in PAGE_API)
        problems += [f"defines {klass.__qualname__}.{name}: {_CHANGE}; {PAGE_API[name]}" for name in defined]
        read: dict[str, str] = {}
        stored: set[str] = set()
        for member, code in _codes(klass):
            names = code.co_varnames[: code.co_argcount]
            if names:
                _scan(code, names[0], member, read, stored)
        for name in sorted(set(read) - stored - set(defined)):
            where = f"{klass.__qualname__}.{read[name]}"
            problems.append(f"{where} reads {name} on the backend: {_CHANGE}; {PAGE_API[name]}")
    return problems


def backend_member(store: Any, name: str) -> str | None:
    """Why ``store.name`` fails where ``name`` is the backend's member (0.2's make_storage returned the backend)."""
    backend = store.__dict__.get("backend")
    if backend is None or name.startswith("__") or not (name in vars(backend) or hasattr(type(backend), name)):
        return None
    return (f"'PageStore' object has no attribute {name!r}: it is the backend's ({type(backend).__name__}.{name}). "
            "0.2's make_storage returned the backend; since hicache-core 0.3.0 it returns the PageStore, which "
            f"reached the backend's members until 0.4.0: use store.backend.{name}")  # fmt: skip


def _codes(klass: type) -> list[tuple[str, CodeType]]:
    """The code of every function ``klass`` defines (properties' accessors and wrapped methods included)."""
    found = []
    for name, member in vars(klass).items():
        functions = [member.fget, member.fset, member.fdel] if isinstance(member, property) else [member]
        for function in functions:
            function = getattr(function, "__func__", function)  # staticmethod, classmethod
            if callable(function) and not isinstance(function, type):
                code = getattr(inspect.unwrap(function), "__code__", None)  # the scrubbing wrapper's original
                if isinstance(code, CodeType):
                    found.append((name, code))
    return found


def _scan(code: CodeType, own: str, member: str, read: dict[str, str], stored: set[str]) -> None:
    """Page API names ``code`` (and the functions nested in it) reads or sets on ``own`` (its instance) or super()."""
    recent: list[dis.Instruction] = []
    for ins in dis.get_instructions(code):
        on_own = bool(recent) and _loads(recent[-1], own)
        if ins.argval in PAGE_API:
            if ins.opname in _ATTRIBUTE_LOADS and (on_own or ins.opname == "LOAD_SUPER_ATTR" or _after_super(recent)):
                read.setdefault(ins.argval, member)
            elif ins.opname == "STORE_ATTR" and on_own:
                stored.add(ins.argval)
        if ins.opname not in ("CACHE", "EXTENDED_ARG", "PRECALL"):
            recent = [*recent[-3:], ins]
    for const in code.co_consts:
        if isinstance(const, CodeType):  # a nested function, lambda or comprehension sees the instance as a free name
            _scan(const, own, member, read, stored)


def _loads(ins: dis.Instruction, own: str) -> bool:
    """Whether ``ins`` leaves the local or free name ``own`` on top of the stack (3.13's pairs included)."""
    if "LOAD_FAST" not in ins.opname and ins.opname not in ("LOAD_DEREF", "LOAD_CLOSURE"):
        return False
    last = ins.argval[-1] if isinstance(ins.argval, tuple) else ins.argval  # STORE_FAST_LOAD_FAST ('_', 'self')
    return last == own


def _after_super(recent: list[dis.Instruction]) -> bool:
    """Whether the last instructions are a call of ``super()`` (Python before 3.12 has no LOAD_SUPER_ATTR)."""
    return bool(recent) and recent[-1].opname.startswith("CALL") and any(
        i.opname == "LOAD_GLOBAL" and i.argval == "super" for i in recent[:-1])  # fmt: skip
