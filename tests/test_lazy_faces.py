"""Every lazy public face (hicache_core.lazy): each exported name resolves, is then cached, and is listed."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_core.lazy import Moved, lazy_face

ROOT = Path(__file__).resolve().parents[1]
FACES = ["hicache_core", "hicache_core.storage", "hicache_core.testing"]


@pytest.mark.parametrize("face", FACES)
def test_every_exported_name_resolves_is_cached_and_listed(face):
    module = importlib.import_module(face)
    assert sorted(module.__all__) == sorted(set(module.__all__)), "a name listed twice"
    for name in module.__all__:
        value = getattr(module, name)
        assert vars(module)[name] is value, f"{face}.{name} was not cached"
        assert getattr(module, name) is value
    listing = dir(module)
    assert set(module.__all__) <= set(listing) and len(listing) == len(set(listing))
    with pytest.raises(AttributeError, match=rf"^module '{face}' has no attribute 'no_such_name'$") as err:
        module.no_such_name  # noqa: B018
    assert err.value.name == "no_such_name" and err.value.obj is module


def test_importing_a_face_imports_no_torch():
    code = ("import sys, hicache_core, hicache_core.storage, hicache_core.testing, hicache_core.plugins.hookspecs; "
            "print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_moved_names_warn_on_every_read_and_are_not_listed():
    from hicache_core.pool.host_layout import HostPart

    namespace = {"__name__": "hicache_core.fake_geometry", "__package__": "hicache_core"}
    getattr_, dir_ = lazy_face(
        namespace, {}, moved={"HostPart": Moved("hicache_core.pool.host_layout", "hicache_core.pool.host_layout")}
    )
    for _ in range(2):  # not cached: the warning comes every time
        with pytest.warns(DeprecationWarning, match=r"^hicache_core\.fake_geometry\.HostPart moved to "
                                                    r"hicache_core\.pool\.host_layout\.HostPart "
                                                    r"\(hicache-core 0\.2\.0\); the old path goes in "
                                                    r"0\.3\.0$"):  # fmt: skip
            assert getattr_("HostPart") is HostPart
    assert "HostPart" not in namespace and "HostPart" not in dir_()


def test_a_face_built_by_the_helper():
    from hicache_core.plugins.implementation import BACKUP_ALL, LOAD

    namespace = {"__name__": "hicache_core.fake_face", "__package__": "hicache_core"}
    moved = {"OLD_ALL": Moved("hicache_core.plugins.implementation", "hicache_core", "0.2.0", "0.4.0")}
    getattr_, dir_ = lazy_face(namespace, {"LOAD": "plugins.implementation"}, moved=moved)
    assert getattr_("LOAD") == LOAD and namespace["LOAD"] == LOAD
    warning = r"^hicache_core\.fake_face\.OLD_ALL moved to hicache_core\.OLD_ALL \(hicache-core 0\.2\.0\); the old path"
    with pytest.warns(DeprecationWarning, match=warning + r" goes in 0\.4\.0$"):
        with pytest.raises(AttributeError, match="OLD_ALL"):  # the new home must define the name
            getattr_("OLD_ALL")
    assert dir_() == ["LOAD", "__name__", "__package__"] and BACKUP_ALL not in namespace.values()
