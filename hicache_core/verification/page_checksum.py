"""The page checksum of host-tier verification: its definition, and its torch implementation.

One checksum word covers one *group* of up to :data:`GROUP_TOKENS` consecutive items of one page,
in one host layer, of one component (K, V, the MLA row, a page row), read from the **device
pool's own rows** in the order the page lists them. So it depends neither on the host layout nor
on where the page sits in the host pool; it travels with the page to L3 and back unchanged.

Definition. Take the group's bytes as little-endian 32-bit words ``w_j`` (``j`` counts words from
the start of the *page*'s bytes of that layer and component: ``j = token * row_words + word``),
and the odd constants ``c_j = s + j * M2 (mod 2**64)``, where ``s`` is odd and derived from the
layer and the component (:func:`seed`) and ``M2`` is twice the 64-bit golden ratio. The checksum is
``sum(w_j * c_j) mod 2**64``. One pass, one multiply-add per word: cheap enough for the GPU to
take at backup and check after every load while reading its own memory at HBM speed.

What it guarantees (certainly, not just probably):

* any change confined to one 32-bit word, so every flipped bit and any corrupted byte: the
  checksum moves by ``d * c_j`` with ``0 < |d| < 2**32`` and ``c_j`` odd, never 0 mod 2**64;
* two distinct words of a group swapped (tokens, heads or whole rows exchanged inside the page):
  the checksum moves by ``(w_i - w_j) * M2 * (j - i)``, and the powers of two in those three
  factors add up to less than 64 for any page under 2**31 words;
* groups are position-dependent, so a group moved to another place of its page is caught as above.

And, with overwhelming probability rather than certainty (the checksum is linear, so a crafted
pattern of several changed words can cancel): a page from another layer or component (another
seed), another page altogether (swapped pages), a page never written (stale bytes). It is an
integrity check against accidents, not a MAC against an adversary.

Rows must be whole 32-bit words; pools whose rows are not are refused ``verify=True`` at construction.
"""

from __future__ import annotations

import math

import torch

#: Items per checksum word: one word covers this many consecutive items (tokens) of a page.
GROUP_TOKENS = 8
#: A table word that holds no checksum: the page's bytes came by other means than a backup (written through
#: raw pointers, or the slot freed since). The first load of the page takes its checksum instead of checking
#: it. (A real checksum word equal to it, one chance in 2**64, is taken again rather than checked.)
NO_CHECKSUM = 0x7FFFFFFFFFFFFFFF
#: Twice the 64-bit golden ratio, mod 2**64 (fits a signed int64: kernels and torch use int64 arithmetic).
M2 = (2 * 0x9E3779B97F4A7C15) % (1 << 64)
_MASK64 = (1 << 64) - 1
_LOW32 = 0xFFFFFFFF
assert M2 < (1 << 63)


#: int64 columns of a kernel entry: device layer offset, row stride (bytes), row words, seed, table column, rows.
ENTRY_COLUMNS = 6
#: int64 columns of an entry of the load that checks in its copy (:mod:`hicache_core.gpu.checked_load`), one per
#: host layer and component, in its kernel's order: where the layer's device rows start, their stride, their 32-bit
#: words; the checksum's seed and table column; device rows; where the host layer starts, its page, item and head
#: strides, words per head; host items. Addresses and strides count 32-bit words from the kernel's anchor.
CHECKED_LOAD_FIELDS = ("device_layer", "row_stride", "row_words", "seed", "column", "rows", "host_layer",
                       "page_stride", "token_stride", "head_stride", "head_words", "host_items")  # fmt: skip


#: Words one step of the page checksum kernel reads (rows x words): with two 64-bit sums per word, a tile of
#: 64 x 32 words keeps them in registers with the next tiles' loads in flight; 64 x 64 spilled
#: (benchmarks/results/verify-check-variants-h200.json).
TILE_WORDS = 2048
#: Words a step reads along the row of a page of one item (a page kind's row, a Mamba request): 512 checked
#: the page kinds' rows of 512 to 2336 words 2.3 times faster than 2048, which holds fewer programs per SM
#: (benchmarks/results/verify-check-variants-pages-h100.json).
ROW_TILE_WORDS = 512
#: Pages one program of the page checksum kernel takes where a page is one row no wider than a step
#: (:data:`ROW_TILE_WORDS`): MXFP8 scale pages, 2 KiB. One program a page spent more of its time on the chain of
#: loads that finds its row (entry, indices, table word) than on the row. The pages are read side by side, a
#: step's words shared among them, so a program holds the registers it did. Wider rows (NVFP4's 36 KiB, a Mamba
#: request's megabytes) keep a program each: they fill it, and fewer programs would leave SMs idle.
ROW_PAGES = 4


def tile_shape(tokens: int, row_words: int) -> tuple[int, int, int]:
    """``(TILE_T, GROUP, BLOCK_W)`` for pages of ``tokens`` items whose widest row has ``row_words`` words.

    A page of fewer than 64 items (a page kind's page is one row; pages of one token) widens its tile along
    the row instead, up to :data:`TILE_WORDS` (:data:`ROW_TILE_WORDS` for a page of one item): a 2 MiB Mamba
    state row read 32 words a step took 16384 steps.
    """
    tile_t = min(64, 1 << (tokens - 1).bit_length())
    group = min(GROUP_TOKENS, tile_t)
    widest = ROW_TILE_WORDS if tile_t == 1 else TILE_WORDS // tile_t
    block_w = min(widest, 1 << max(2, (row_words - 1).bit_length()))
    return tile_t, group, block_w


def pages_per_program(tokens: int, row_words: int) -> int:
    """Pages one program of the page checksum kernel takes (:data:`ROW_PAGES`, else one)."""
    return ROW_PAGES if tokens == 1 and row_words <= ROW_TILE_WORDS else 1


def groups_per_page(tokens_per_page: int) -> int:
    """Checksum words per page, layer and component."""
    return math.ceil(tokens_per_page / GROUP_TOKENS)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seed(layer: int, component: int) -> int:
    """The odd constant ``s`` of (host layer, component), as a signed int64 (the bits of the uint64)."""
    s = _splitmix64((layer << 16) ^ component ^ 0x48494341434845) | 1  # "HICACHE"
    return s - (1 << 64) if s >= (1 << 63) else s


def row_words(row_bytes: int) -> int:
    """32-bit words per device row; raise for rows that are not whole words."""
    if row_bytes % 4:
        raise ValueError(f"a device row of {row_bytes} bytes is not a whole number of 32-bit words")
    return row_bytes // 4


def checksum_rows(rows: torch.Tensor, layer: int, component: int, tokens_per_page: int) -> torch.Tensor:
    """Checksum words of pages given as device rows, in torch (CPU pools, tests, tools).

    :param rows: ``(pages * tokens_per_page, row_bytes)`` uint8, or any tensor whose rows are the
        device rows of the pages, in page order (gathered by the caller).
    :returns: ``(pages, groups_per_page(tokens_per_page))`` int64 (the bits of the uint64 sums).
    """
    flat = rows.reshape(rows.shape[0], -1)
    if flat.dtype != torch.uint8:
        flat = flat.contiguous().view(torch.uint8)
    n, nbytes = flat.shape
    w = row_words(nbytes)
    t = tokens_per_page
    if n % t:
        raise ValueError(f"{n} rows are not whole pages of {t}")
    words = flat.contiguous().view(torch.int32).to(torch.int64) & _LOW32
    pos = torch.arange(t * w, dtype=torch.int64).view(t, w)
    consts = seed(layer, component) + pos * M2  # int64 arithmetic wraps: the low 64 bits are the uint64's
    products = words.view(n // t, t, w) * consts
    g = groups_per_page(t)
    pad = g * GROUP_TOKENS - t
    per_token = products.sum(dim=2)
    if pad:
        per_token = torch.nn.functional.pad(per_token, (0, pad))
    return per_token.view(n // t, g, GROUP_TOKENS).sum(dim=2)


def checksum_bytes_reference(
    data: bytes, layer: int, component: int, row_bytes: int, tokens_per_page: int
) -> list[int]:
    """The definition in plain Python integers, for one page's bytes (the tests' oracle)."""
    w = row_words(row_bytes)
    s = seed(layer, component) & _MASK64
    out = [0] * groups_per_page(tokens_per_page)
    for j in range(len(data) // 4):
        word = int.from_bytes(data[4 * j : 4 * j + 4], "little")
        g = (j // w) // GROUP_TOKENS
        out[g] = (out[g] + word * ((s + j * M2) & _MASK64)) & _MASK64
    return [v - (1 << 64) if v >= (1 << 63) else v for v in out]
