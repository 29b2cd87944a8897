"""Whether this process's CUDA context still works (the kit checks after every CUDA case)."""

from __future__ import annotations

import torch


def context_lost() -> str | None:
    """Why the CUDA context is unusable now (a sticky error shows at the next synchronize), or ``None``."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return str(exc)
    return None
