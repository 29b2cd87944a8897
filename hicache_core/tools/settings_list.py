"""``hicache settings``: every declared ``HICACHE_*`` variable, its value now, where that came from, what it takes.

The list is :func:`hicache_core.settings.registry.current`: the core's settings and every installed plugin's
and adapter's (their ``hicache.settings`` entry points). A value a setting does not take is shown as
refused, with the reason, and the command exits 1, so that a launcher can check its environment first.
"""

from __future__ import annotations

import json
import sys

from ..settings.registry import DeclarationError, current


def run(as_json: bool = False) -> int:
    """Print the settings (a table, or ``--json``); 1 if any variable holds a value its setting refuses, 2 if
    a declaration is broken (a variable declared twice, a plugin's list that does not load)."""
    try:
        rows = current()
    except DeclarationError as exc:
        print(f"hicache settings: {exc}", file=sys.stderr)
        return 2
    refused = [row for row in rows if row.error]
    if as_json:
        print(json.dumps([row.as_dict() for row in rows], indent=2))
    else:
        width = max(len(row.name) for row in rows)
        value_width = min(24, max(len(row.value) for row in rows))
        print(f"{'variable':<{width}}  {'value':<{value_width}}  {'from':<11}  takes")
        for row in rows:
            print(f"{row.name:<{width}}  {row.value:<{value_width}}  {row.source:<11}  {row.takes}")
            print(f"{'':<{width}}  {row.doc} [{row.declared_by}]")
    for row in refused:
        print(f"hicache settings: refused: {row.error}", file=sys.stderr)
    return 1 if refused else 0
