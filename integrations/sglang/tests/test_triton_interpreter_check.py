"""The root conftest's speed-up of Triton's overflow check is in place in this environment's triton (3.8.0).

The root conftest pins it per triton (``_CHECK_PINNED``); a triton change in requirements-ci.txt fails here,
naming what differs, until the new source is read and the pin updated.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import triton
from triton.runtime import interpreter

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")


def test_the_overflow_check_speed_up_is_installed_for_this_triton(request):
    root = str(Path(str(request.config.rootpath)) / "conftest.py")
    plugin = next((p for p in request.config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == root),
                  None)  # fmt: skip
    assert plugin is not None, f"{root} is not loaded"
    assert plugin.check_mismatches(triton.__version__, interpreter) == []
    assert plugin.check_installed
    assert interpreter.TritonSemantic.binary_op_sanitize_overflow_impl.__name__ == "check_where_asserted"
