"""SGLang 0.5.23's host-pool constructors beyond ``build_kv_host_pool``, taken over by hicache, one module per family.

Each :class:`Takeover` names a SGLang module attribute (a host pool class SGLang calls as a
constructor) and the hicache builder that takes the same arguments; :func:`install` replaces
it in that module only (other modules keep SGLang's class for their ``isinstance`` checks)
and registers hicache's pool class as a virtual subclass of SGLang's, so those checks keep
their answer. :data:`REFUSALS` names, as data, the families that stay SGLang's: their
builders refuse at start-up, naming the flag or model that leads to them (and
:func:`not_served_line` is logged once at install).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Takeover:
    """One SGLang host-pool constructor hicache replaces.

    :param family: the pool family, as ``hicache matrix --sglang`` names it.
    :param module: the SGLang module whose attribute SGLang calls to build the pool.
    :param attr: the constructor's name there (SGLang's class).
    :param builder: ``".module:function"`` in this package, taking the constructor's arguments.
    :param pool_class: ``".module:Class"`` of the hicache pool it returns.
    :param kind: the hicache pool kind the family's pools are made of.
    :param how: what SGLang configuration builds it.
    :param virtual_base: ``"module:Class"`` of SGLang's host pool class the pool stands for, when the
        replaced attribute is a function (so SGLang's ``isinstance`` checks still answer yes).
    """

    family: str
    module: str
    attr: str
    builder: str
    pool_class: str
    kind: str
    how: str
    virtual_base: str = ""


@dataclass(frozen=True)
class Refusal:
    """A SGLang host-pool family that stays SGLang's: its builder refuses, at start-up, with a reason.

    :param family: the pool family.
    :param module: the SGLang module whose function builds it.
    :param attr: that function (replaced by one that raises :class:`~hicache_sglang.NotServedError`).
    :param pools: SGLang's host pool classes it would build.
    :param how: the flag or model that leads to it.
    """

    family: str
    module: str
    attr: str
    pools: str
    how: str


_HOST = "sglang.srt.mem_cache.pool_host"
_ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
_HISPARSE = "sglang.srt.managers.hisparse_coordinator"
# Only the modules named here are patched: other modules use SGLang's classes in isinstance checks.
TAKEOVERS: tuple[Takeover, ...] = (
    Takeover("dsa_indexer", f"{_HOST}.dsa", "DSAIndexerPoolHost", ".dsa:build_dsa_indexer_host_pool",
             ".dsa:SGLangDSAIndexerHostPool", "page_rows",
             "DSA models (DeepSeek-V3.2, GLM-5): index keys beside the MLA anchor, and the separate draft indexer"),
    Takeover("deepseek_v4_logical", _ASSEMBLER, "LogicalHostPool", ".dsv4:SGLangLogicalHostPool",
             ".dsv4:SGLangLogicalHostPool", "(slots only)", "DeepSeek-V4: the FULL anchor (slots, no bytes)"),
    Takeover("deepseek_v4_paged", _ASSEMBLER, "DeepSeekV4PagedHostPool", ".dsv4:SGLangDeepSeekV4PagedHostPool",
             ".dsv4:SGLangDeepSeekV4PagedHostPool", "dsv4_paged",
             "DeepSeek-V4: SWA, C4 and C128 KV, C4 indexer sub-pools, and the MTP draft SWA pool"),
    Takeover("deepseek_v4_state", _ASSEMBLER, "DeepSeekV4StateHostPool", ".dsv4:SGLangDeepSeekV4StateHostPool",
             ".dsv4:SGLangDeepSeekV4StateHostPool", "dsv4_state", "DeepSeek-V4: C4 and C4-indexer compress states"),
    Takeover("mtp_draft", _ASSEMBLER, "_build_mha_mla_host_pool", ".drafts:build_mha_mla_host_pool",
             "..pool:SGLangHostPool", "mha / mla",
             "speculative decoding with a separate (non-packed) draft KV pool: build_full_draft_pools, "
             "build_swa_draft_pools"),
    Takeover("mamba", _ASSEMBLER, "build_mamba_host_pool", ".mamba:build_mamba_host_pool",
             ".mamba:SGLangMambaHostPool", "mamba",
             "hybrid Mamba / linear-attention models (Qwen3-Next, Nemotron-H, ...): build_hybrid_mamba_stack",
             virtual_base=f"{_HOST}.mamba:MambaPoolHost"),
    # The assembler imported the class by name: its own reference is the one it calls.
    Takeover("qsa_indexer", _ASSEMBLER, "QSAIndexerPoolHost", ".qsa:SGLangQSAIndexerHostPool",
             ".qsa:SGLangQSAIndexerHostPool", "dsv4_paged",
             "QSA sparse-attention models (QSATokenToKVPool): compressed keys beside the KV anchor, and the draft's"),
    # The HiSparse coordinator builds its host pool itself, from names in its own module (none is used in a check
    # there). Refused unless hisparse.ENV_SWAP_IN accepts SGLang's swap-in kernels reading hicache's bytes.
    Takeover("hisparse_mla", _HISPARSE, "MLATokenToKVPoolHost", ".hisparse:SGLangHiSparseMLAHostPool",
             ".hisparse:SGLangHiSparseMLAHostPool", "mla", "--enable-hisparse (MLA models: DeepSeek-V3.2, GLM-5)"),
    Takeover("hisparse_mha", _HISPARSE, "HiSparseMHATokenToKVPoolHost", ".hisparse:SGLangHiSparseMHAHostPool",
             ".hisparse:SGLangHiSparseMHAHostPool", "mha", "--enable-hisparse (MHA models: MiniMax-M3)"),
    Takeover("hisparse_dsv4", _HISPARSE, "DeepSeekV4PagedHostPool", ".hisparse_dsv4:SGLangHiSparseDSV4HostPool",
             ".hisparse_dsv4:SGLangHiSparseDSV4HostPool", "dsv4_paged", "--enable-hisparse (DeepSeek-V4)"),
    # build_minimax_m3_sparse_stack imports these two by name from their module when it runs.
    Takeover("minimax_m3_nvfp4", _HOST + ".minimax_m3_nvfp4", "MiniMaxM3Nvfp4MainKVPoolHost",
             ".minimax:SGLangMiniMaxM3Nvfp4MainKVPoolHost", ".minimax:SGLangMiniMaxM3Nvfp4MainKVPoolHost",
             "nvfp4_page_rows", "MiniMax-M3 with an NVFP4 KV cache: the main K/V page rows (scales inside)"),
    Takeover("minimax_m3_nvfp4_index_k", _HOST + ".minimax_m3_nvfp4", "MiniMaxM3Nvfp4IndexKPoolHost",
             ".minimax:SGLangMiniMaxM3Nvfp4IndexKPoolHost", ".minimax:SGLangMiniMaxM3Nvfp4IndexKPoolHost",
             "nvfp4_page_rows", "MiniMax-M3 with an NVFP4 KV cache: the sparse index-K page rows (scales inside)"),
    Takeover("minimax_index_k", _ASSEMBLER, "MHATokenToKOnlyPoolHost", ".minimax:SGLangKOnlyHostPool",
             ".minimax:SGLangKOnlyHostPool", "mha_k_only",
             "MiniMax-M3 sparse attention without NVFP4: the index-K pool beside the KV anchor"),
)  # fmt: skip

#: Every family SGLang 0.5.23 builds is served now; a family added here is refused at start-up, named in one line.
REFUSALS: tuple[Refusal, ...] = ()

_patched: list[tuple[Any, str, Any]] = []


def resolve(ref: str) -> Any:
    """``".module:name"`` (relative to this package) -> the object."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module, __name__), name)


def _import_ref(ref: str) -> Any:
    """``"module:name"`` (absolute) -> the object."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _refuser(refusal: Refusal):
    from ..errors import NotServedError

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotServedError(
            f"hicache-sglang does not serve SGLang's {refusal.family} host pools ({refusal.pools}) yet; SGLang builds "
            f"them for {refusal.how}. hicache will not serve such a stack half by hicache and half by SGLang: run "
            "this model without hicache_sglang.install(), or without that setting."
        )

    refuse.__name__ = refusal.attr
    refuse.__qualname__ = f"hicache_refusal.{refusal.attr}"
    return refuse


def install() -> None:
    """Replace every constructor in :data:`TAKEOVERS`, and every builder in :data:`REFUSALS` (once)."""
    if _patched:
        return
    for takeover in TAKEOVERS:
        module = importlib.import_module(takeover.module)
        original = getattr(module, takeover.attr)
        base = _import_ref(takeover.virtual_base) if takeover.virtual_base else original
        if hasattr(base, "register"):  # an ABC: SGLang's isinstance checks elsewhere answer yes
            base.register(resolve(takeover.pool_class))
        setattr(module, takeover.attr, resolve(takeover.builder))
        _patched.append((module, takeover.attr, original))
    for refusal in REFUSALS:
        module = importlib.import_module(refusal.module)
        original = getattr(module, refusal.attr)
        setattr(module, refusal.attr, _refuser(refusal))
        _patched.append((module, refusal.attr, original))


def uninstall() -> None:
    """Give SGLang its own constructors and builders back."""
    for module, attr, original in reversed(_patched):
        setattr(module, attr, original)
    _patched.clear()


def not_served_line() -> str:
    """One line naming what stays SGLang's (refused when SGLang builds it), with what leads to it."""
    if not REFUSALS:
        return "hicache-sglang serves every host pool family SGLang builds; none is refused"
    return "hicache-sglang refuses, when SGLang builds them, the host pools it does not serve yet: " + "; ".join(
        f"{r.family} ({r.pools}; {r.how})" for r in REFUSALS
    )
