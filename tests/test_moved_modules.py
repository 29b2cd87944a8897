"""The core's modules moved into rooms: every old path still imports, the same module, with a warning naming the new."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hicache_core
from hicache_core.lazy import MODULES_GO_IN, MOVED_MODULES

CORE = Path(hicache_core.__file__).parent


@pytest.mark.parametrize("old,new", sorted(MOVED_MODULES.items()))
def test_an_old_path_imports_the_module_at_its_new_one_with_a_warning(old, new):
    assert not (CORE / f"{old.rpartition('.')[2]}.py").exists(), f"{old} is still a file: it was not moved"
    fresh = old not in sys.modules
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new) and module.__name__ == new
    if fresh:  # the first import of the old path says where it went and when the old path goes
        said = [str(w.message) for w in caught if w.category is DeprecationWarning]
        assert said == [f"{old} moved to {new} (hicache-core 0.4.0); the old path goes in {MODULES_GO_IN}"]


def test_the_core_keeps_at_most_twelve_modules_at_its_top():
    top = sorted(p.name for p in CORE.glob("*.py"))
    assert len(top) <= 12, top


def test_a_plugin_written_against_the_old_paths_runs_in_a_fresh_process():
    # What a third party's code does: import names from the modules as they were before the rooms.
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n"
        "    from hicache_core.implementation import Implementation\n"
        "except DeprecationWarning as w:\n"
        "    print('warned:', w)\n"
        "warnings.simplefilter('ignore')\n"
        "from hicache_core.implementation import Implementation\n"
        "from hicache_core.plan import TransferPlan\n"
        "from hicache_core.verification import Verification\n"
        "import hicache_core.registry as r\n"
        "from hicache_core import Implementation as I2, make_host_pool\n"
        "import hicache_core.plugins.registry as new\n"
        "import hicache_core as hc\n"
        "assert hc.versions is hc.plugins.versions and hc.host_pool is hc.pool.host_pool\n"
        "assert Implementation is I2 and r is new\n"
        "print('ok', TransferPlan.__module__, Verification.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "warned: hicache_core.implementation moved to hicache_core.plugins.implementation (hicache-core 0.4.0); "
        f"the old path goes in {MODULES_GO_IN}",
        "ok hicache_core.pool.plan hicache_core.verification.observer",
    ]
