"""SGLang 0.5.23's host-pool families, declared once, as data: who builds them, in which layouts.

Each :class:`Family` is one SGLang constructor of host pools and the pools it builds. The
adapter installs from it (:func:`hicache_sglang.builders.install` replaces every ``module.attr``
named here; ``build_kv_host_pool`` is replaced by :func:`hicache_sglang.install` itself, in
every module that imported it) and ``python -m hicache_sglang.matrix`` renders it, asking
hicache's registry which io backends serve each pool in each layout.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The io backends SGLang's controller passes (``--hicache-io-backend``).
IO_BACKENDS = ("kernel", "direct")


@dataclass(frozen=True)
class Pool:
    """One host pool a family's constructor builds: SGLang's class, hicache's kind, the layouts SGLang allows.

    :param with_kinds: kinds of the pools that ride beside it in the same calls (MXFP8's scales beside
        the K/V): they must be served too.
    :param io_backends: the io backends SGLang can ask of it (HiSparse's coordinator always passes
        ``kernel``).
    """

    name: str
    sglang: str
    kind: str
    layouts: tuple[str, ...]
    sharded: bool = False
    with_kinds: tuple[str, ...] = ()
    io_backends: tuple[str, ...] = IO_BACKENDS


@dataclass(frozen=True)
class Family:
    """One SGLang host-pool constructor that hicache takes over, and the pools it builds.

    :param family: its short name.
    :param how: what SGLang configuration builds it.
    :param pools: the pools it builds (none: slots only, no bytes move).
    :param module: the SGLang module whose attribute SGLang calls to build the pool (only that
        module is patched: others keep SGLang's class for their ``isinstance`` checks). Empty for
        ``build_kv_host_pool``, which :func:`hicache_sglang.install` replaces everywhere.
    :param attr: the constructor's name there (SGLang's class, or a function).
    :param builder: ``".module:function"`` in :mod:`hicache_sglang.builders`, taking the constructor's
        arguments.
    :param pool_class: ``".module:Class"`` (same package) of the hicache pool it returns.
    :param virtual_base: ``"module:Class"`` of SGLang's host pool class the pool stands for, when
        ``attr`` is a function (so that SGLang's ``isinstance`` checks still answer yes).
    """

    family: str
    how: str
    pools: tuple[Pool, ...]
    module: str = ""
    attr: str = ""
    builder: str = ""
    pool_class: str = ""
    virtual_base: str = ""


_HOST = "sglang.srt.mem_cache.pool_host"
_ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
_HISPARSE = "sglang.srt.managers.hisparse_coordinator"
_MHA = ("layer_first", "page_first", "page_first_direct", "page_head")
_MLA = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")
_ROWS = ("layer_first", "page_first", "page_first_direct")

FAMILIES: tuple[Family, ...] = (
    Family("kv", "every KV host pool: the radix tree's, the hybrid stacks', the decode-offload one", (
        Pool("KV, MHA", "MHATokenToKVPoolHost", "mha", _MHA),
        Pool("KV, MHA head_dim != v_head_dim", "AsymmetricMHATokenToKVPoolHost", "mha_asym",
             ("page_first", "page_first_direct")),
        Pool("KV, MLA", "MLATokenToKVPoolHost", "mla", _MLA),
        Pool("KV, MLA, layer-split (--enable-dsa-cache-layer-split)", "MLATokenToKVPoolHost", "mla", _MLA,
             sharded=True),
        Pool("KV, MHA MXFP8 (FP8 K/V + interleaved E8M0 scales, page size 128)", "MHATokenToKVPoolMXFP8Host", "mha",
             ("page_first",), with_kinds=("kv_scale_pages",)),
    )),
    Family("mtp_draft", "speculative decoding with a separate (non-packed) draft KV pool: build_full_draft_pools, "
           "build_swa_draft_pools", (
               Pool("MTP draft KV (non-packed), MHA", "MHATokenToKVPoolHost", "mha", _MHA),
               Pool("MTP draft KV (non-packed), MLA", "MLATokenToKVPoolHost", "mla", _MLA),
           ), _ASSEMBLER, "_build_mha_mla_host_pool", ".drafts:build_mha_mla_host_pool", "..pool:SGLangHostPool"),
    Family("dsa_indexer", "DSA models (DeepSeek-V3.2, GLM-5): index keys beside the MLA anchor, and the separate "
           "draft indexer", (
               Pool("DSA indexer", "DSAIndexerPoolHost", "page_rows", _MLA),
               Pool("DSA indexer, layer-split", "DSAIndexerPoolHost", "page_rows", _MLA, sharded=True),
           ), f"{_HOST}.dsa", "DSAIndexerPoolHost", ".dsa:build_dsa_indexer_host_pool",
           ".dsa:SGLangDSAIndexerHostPool"),
    Family("deepseek_v4_logical", "DeepSeek-V4: the FULL anchor (slots, no bytes)", (),
           _ASSEMBLER, "LogicalHostPool", ".dsv4:SGLangLogicalHostPool", ".dsv4:SGLangLogicalHostPool"),
    Family("deepseek_v4_paged", "DeepSeek-V4: SWA, C4 and C128 KV, C4 indexer sub-pools, and the MTP draft SWA pool", (
               Pool("DeepSeek-V4 paged (SWA, C4, C128, C4 indexer, draft SWA)", "DeepSeekV4PagedHostPool",
                    "dsv4_paged", _ROWS),
           ), _ASSEMBLER, "DeepSeekV4PagedHostPool", ".dsv4:SGLangDeepSeekV4PagedHostPool",
           ".dsv4:SGLangDeepSeekV4PagedHostPool"),
    Family("deepseek_v4_state", "DeepSeek-V4: C4 and C4-indexer compress states", (
               Pool("DeepSeek-V4 compress state", "DeepSeekV4StateHostPool", "dsv4_state", _ROWS),
           ), _ASSEMBLER, "DeepSeekV4StateHostPool", ".dsv4:SGLangDeepSeekV4StateHostPool",
           ".dsv4:SGLangDeepSeekV4StateHostPool"),
    # The assembler imported the class by name: its own reference is the one it calls.
    Family("qsa_indexer", "QSA sparse-attention models (QSATokenToKVPool): compressed keys beside the KV anchor, "
           "and the draft's", (
               Pool("QSA indexer (compressed keys)", "QSAIndexerPoolHost", "dsv4_paged", _ROWS),
           ), _ASSEMBLER, "QSAIndexerPoolHost", ".qsa:SGLangQSAIndexerHostPool", ".qsa:SGLangQSAIndexerHostPool"),
    Family("mamba", "hybrid Mamba / linear-attention models (Qwen3-Next, Nemotron-H, ...): build_hybrid_mamba_stack", (
               Pool("Mamba / linear-attention state", "MambaPoolHost", "mamba", ("page_first", "page_first_direct")),
           ), _ASSEMBLER, "build_mamba_host_pool", ".mamba:build_mamba_host_pool", ".mamba:SGLangMambaHostPool",
           virtual_base=f"{_HOST}.mamba:MambaPoolHost"),
    # build_minimax_m3_sparse_stack imports these two by name from their module when it runs.
    Family("minimax_m3_nvfp4", "MiniMax-M3 with an NVFP4 KV cache: the main K/V page rows (scales inside)", (
               Pool("MiniMax-M3 NVFP4 main K/V (block scales inside the rows)", "MiniMaxM3Nvfp4MainKVPoolHost",
                    "nvfp4_page_rows", _ROWS),
           ), f"{_HOST}.minimax_m3_nvfp4", "MiniMaxM3Nvfp4MainKVPoolHost",
           ".minimax:SGLangMiniMaxM3Nvfp4MainKVPoolHost", ".minimax:SGLangMiniMaxM3Nvfp4MainKVPoolHost"),
    Family("minimax_m3_nvfp4_index_k", "MiniMax-M3 with an NVFP4 KV cache: the sparse index-K page rows (scales "
           "inside)", (
               Pool("MiniMax-M3 NVFP4 index K (block scales inside the rows)", "MiniMaxM3Nvfp4IndexKPoolHost",
                    "nvfp4_page_rows", _ROWS),
           ), f"{_HOST}.minimax_m3_nvfp4", "MiniMaxM3Nvfp4IndexKPoolHost",
           ".minimax:SGLangMiniMaxM3Nvfp4IndexKPoolHost", ".minimax:SGLangMiniMaxM3Nvfp4IndexKPoolHost"),
    Family("minimax_index_k", "MiniMax-M3 sparse attention without NVFP4: the index-K pool beside the KV anchor", (
               Pool("MiniMax sparse index K (K only)", "MHATokenToKOnlyPoolHost", "mha_k_only", _ROWS),
           ), _ASSEMBLER, "MHATokenToKOnlyPoolHost", ".minimax:SGLangKOnlyHostPool", ".minimax:SGLangKOnlyHostPool"),
    # The HiSparse coordinator builds its host pool itself, from names in its own module (none is used in a check
    # there). Refused unless hisparse.SWAP_IN accepts SGLang's swap-in kernels reading hicache's bytes.
    Family("hisparse_mla", "--enable-hisparse (MLA models: DeepSeek-V3.2, GLM-5)", (
               Pool("HiSparse, MLA (--enable-hisparse; swap-in by SGLang's kernels, opt-in)", "MLATokenToKVPoolHost",
                    "mla", ("layer_first",), io_backends=("kernel",)),
           ), _HISPARSE, "MLATokenToKVPoolHost", ".hisparse:SGLangHiSparseMLAHostPool",
           ".hisparse:SGLangHiSparseMLAHostPool"),
    Family("hisparse_mha", "--enable-hisparse (MHA models: MiniMax-M3)", (
               Pool("HiSparse, MiniMax-M3 MHA (--enable-hisparse; swap-in by SGLang's kernels, opt-in)",
                    "HiSparseMHATokenToKVPoolHost", "mha", ("layer_first",), io_backends=("kernel",)),
           ), _HISPARSE, "HiSparseMHATokenToKVPoolHost", ".hisparse:SGLangHiSparseMHAHostPool",
           ".hisparse:SGLangHiSparseMHAHostPool"),
    Family("hisparse_dsv4", "--enable-hisparse (DeepSeek-V4)", (
               Pool("HiSparse, DeepSeek-V4 C4 (--enable-hisparse; 8-byte words of the page rows; swap-in by SGLang's "
                    "kernels, opt-in)", "DeepSeekV4PagedHostPool", "dsv4_paged", ("layer_first",),
                    io_backends=("kernel",)),
           ), _HISPARSE, "DeepSeekV4PagedHostPool", ".hisparse_dsv4:SGLangHiSparseDSV4HostPool",
           ".hisparse_dsv4:SGLangHiSparseDSV4HostPool"),
)  # fmt: skip

#: The families :func:`hicache_sglang.builders.install` takes over (each names its constructor).
TAKEOVERS: tuple[Family, ...] = tuple(f for f in FAMILIES if f.module)
#: Every pool of every family, in order (the matrix's rows).
POOLS: tuple[Pool, ...] = tuple(p for f in FAMILIES for p in f.pools)
