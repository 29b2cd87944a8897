"""Errors raised while a host pool moves bytes: the implementation and its plugin named, input errors kept."""

from __future__ import annotations

import torch

from ..plugins.implementation import Implementation


class TransferError(RuntimeError):
    """An implementation raised while moving bytes (or while binding to a pool); names it and its plugin."""

    def __init__(self, impl: type[Implementation] | Implementation, plugin: str, operation: str,
                 cause: BaseException) -> None:  # fmt: skip
        self.implementation = impl.name
        self.plugin = plugin
        self.operation = operation
        super().__init__(
            f"{impl.name} (plugin {plugin}, io backend {impl.io_backend!r}) raised during {operation}: "
            f"{type(cause).__name__}: {cause}"
        )


def _refuse_meta(*indices) -> None:
    """Indices on the meta device are the caller's mistake, not the plugin's: say so, from the error path only
    (so the hot path pays nothing for the check), in place of whatever the implementation raised."""
    for what, idx in zip(("host_indices", "device_indices"), indices):
        if isinstance(idx, torch.Tensor) and idx.is_meta:
            raise ValueError(f"{what} is on the meta device, which holds no values: pass real indices")


def _note(impl: type[Implementation] | Implementation, operation: str, exc: Exception) -> None:
    """Input errors raised inside a transfer keep their type (callers catch them as bad input) and gain a note."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised by {impl.name}, io backend {impl.io_backend!r}, during {operation})")
