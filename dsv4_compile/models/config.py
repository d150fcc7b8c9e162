"""Model and cache configuration of the DSV4 attention block.

:class:`DeepseekV4Config` holds the model hyperparameters; its defaults are DeepSeek V4 Flash
(hidden 4096, 64 heads, 43 layers). :class:`CacheConfig` holds the serving-side sizes that fix
every buffer's shape (requests, tokens per request, page size). :func:`tiny_config` builds a small
model for tests and examples: fewer heads are legal, the ops pad internally.

Fixed by the V4 cache layout (:mod:`dsv4_compile.layout`): ``head_dim = 512`` (448 + 64 RoPE dims),
one KV head. Fixed by the architecture: ``compress_ratio`` of a layer is 0 (sliding window only),
4 (overlapping compressor + lightning indexer) or 128 (compressor, all blocks attended).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import layout

COMPRESS_RATIOS = (0, 4, 128)

#: DSV4-Flash layer kinds: two window-only layers, then alternating c4 / c128 layers, and a final
#: window-only entry that belongs to the MTP (next-n) layer (44 entries for 43 + 1 layers).
FLASH_COMPRESS_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)


@dataclass(frozen=True)
class DeepseekV4Config:
    """DSV4 hyperparameters (defaults: DeepSeek V4 Flash, as in its ``config.json``)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    q_lora_rank: int = 1024
    head_dim: int = layout.HEAD_DIM
    qk_rope_head_dim: int = layout.ROPE_DIM
    o_lora_rank: int = 1024
    o_groups: int = 8
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN (compressed layers only): frequency blend over the original context length
    rope_factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    compress_ratios: tuple[int, ...] = FLASH_COMPRESS_RATIOS
    #: width of the small SwiGLU MLP of the test model (0: no MLP); DSV4's MoE is out of scope
    intermediate_size: int = 0
    #: ratio-4 layers per indexer run (a serving option, not DSV4's: 1, the default, gives every
    #: ratio-4 layer its own selection). With ``n > 1`` the first of every ``n`` consecutive ratio-4
    #: layers runs its indexer and the next ``n - 1`` attend the blocks it selected, their own
    #: indexers not run (weights and key caches kept, unused): the indexer's cost at long context
    #: divided by ``n``, at the cost of selections another layer's indexer made
    index_reuse: int = 1

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        if type(self.index_reuse) is not int or self.index_reuse < 1:
            raise ValueError(f"index_reuse must be an int >= 1 (ratio-4 layers per indexer run), got {self.index_reuse!r}")
        expect = {
            "head_dim": (self.head_dim, layout.HEAD_DIM),
            "qk_rope_head_dim": (self.qk_rope_head_dim, layout.ROPE_DIM),
        }
        for name, (got, want) in expect.items():
            if got != want:
                raise ValueError(f"{name} must be {want} (the V4 cache layout), got {got}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"o_groups ({self.o_groups})"
            )
        bad = [r for r in self.compress_ratios if r not in COMPRESS_RATIOS]
        if bad:
            raise ValueError(f"compress_ratios must be in {COMPRESS_RATIOS}, got {bad}")
        if len(self.compress_ratios) < self.num_hidden_layers:
            raise ValueError(
                f"compress_ratios needs one entry per layer ({self.num_hidden_layers}), "
                f"got {len(self.compress_ratios)}"
            )
        if self.index_head_dim != layout.INDEX_HEAD_DIM:
            raise ValueError(
                f"index_head_dim must be {layout.INDEX_HEAD_DIM} (DSV4's: the indexer key cache's formats "
                f"and its Hadamard rotation are that wide), got {self.index_head_dim}"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of every per-layer buffer: the caches are allocated once, for CUDA-graph capture.

    A request owns ``max_seq_len / page_size`` pages of ``page_size`` tokens; the same page table
    addresses the window cache (``page_size`` tokens a page), the c4 cache (``page_size / 4``
    compressed tokens a page) and the c128 cache (``page_size / 128``): page ``p`` of a request holds
    its tokens ``[p*P, (p+1)*P)`` and the compressed blocks made of them, as SGLang's V4 pool does
    (P = 256: 64 c4 slots, 2 c128 slots a page).

    The caches' formats, by their names in ``layout.FORMATS``: ``kv_format`` is the window cache's
    and, unless named below, the compressed caches'; an FP8 format: ``"v4"`` (584-byte tokens),
    ``"v4.1-fp8"`` (528-byte tokens, block-split pages, as SGLang stores them by default) or
    ``"v4.1-fp8-interleaved"`` (the arrangement FlashMLA's current kernels read).
    ``c4_kv_format`` / ``c128_kv_format``: the ratio-4 / ratio-128 compressed caches' format
    (``None``: ``kv_format``), of the same generation (V4 or V4.1); e.g. a V4.1 model with FP4
    compressed caches on its ratio-4 layers, as DSV4.1 stores them, is ``kv_format="v4.1-fp8",
    c4_kv_format="v4.1-fp4"``.

    ``index_format``: the ratio-4 layers' indexer key cache (``layout.INDEX_FORMATS``): ``"fp8"``
    (132 bytes a compressed block, the default: what SGLang allocates for V4 and V4.1 alike),
    ``"fp4"`` (68 bytes; SGLang's opt-in FP4 indexer) or ``"fp32"`` (512 bytes, the exact scores).
    """

    max_requests: int = 4
    max_seq_len: int = 512
    page_size: int = 256
    kv_format: str = "v4"
    c4_kv_format: str | None = None
    c128_kv_format: str | None = None
    index_format: str = "fp8"

    def __post_init__(self):
        if self.index_format not in layout.INDEX_FORMATS:
            raise ValueError(f"index_format must be one of {list(layout.INDEX_FORMATS)}, got {self.index_format!r}")
        main = layout.FORMATS.get(self.kv_format)
        if main is None or main.values == "fp4":
            fp8 = [name for name, fmt in layout.FORMATS.items() if fmt.values != "fp4"]
            raise ValueError(f"kv_format must be one of {fp8} (the window cache is FP8), got {self.kv_format!r}")
        for arg in ("c4_kv_format", "c128_kv_format"):
            name = getattr(self, arg)
            if name is None:
                continue
            fmt = layout.FORMATS.get(name)
            if fmt is None or fmt.is_v4 != main.is_v4:
                same = [n for n, f in layout.FORMATS.items() if f.is_v4 == main.is_v4]
                raise ValueError(f"{arg} must be None or one of {same} (kv_format={self.kv_format!r}'s "
                                 f"generation), got {name!r}")
        if self.page_size % max(COMPRESS_RATIOS):
            raise ValueError(f"page_size must be a multiple of 128, got {self.page_size}")
        if self.max_seq_len % self.page_size:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) must be a multiple of page_size ({self.page_size})"
            )

    @property
    def pages_per_request(self) -> int:
        return self.max_seq_len // self.page_size

    @property
    def num_pages(self) -> int:
        return self.max_requests * self.pages_per_request

    def cache_format(self, ratio: int) -> str:
        """The format name (``layout.FORMATS``) of the window cache (``ratio`` 0) or of the
        ratio-``ratio`` compressed cache."""
        named = {4: self.c4_kv_format, 128: self.c128_kv_format}.get(ratio)
        return self.kv_format if named is None else named

    def cache_formats(self) -> dict[str, str]:
        """Every cache's format name: ``{"window": ..., "c4": ..., "c128": ..., "indexer": ...}``."""
        compressed = {f"c{r}": self.cache_format(r) for r in COMPRESS_RATIOS if r}
        return {"window": self.cache_format(0), **compressed, "indexer": self.index_format}

    def bytes_per_token(self, ratio: int) -> dict[str, float]:
        """Cache bytes a token of context costs a layer of ``compress_ratio`` ``ratio``, as
        allocated (canonical page strides, padding included): ``{"window": ..., "compressed":
        ..., "indexer": ..., "total": ...}`` (the compressed caches hold one token per ``ratio``)."""
        P = self.page_size  # a page of each cache holds the blocks of P tokens
        out = {"window": layout.cache_format(self.cache_format(0)).page_bytes(P) / P, "compressed": 0.0, "indexer": 0.0}
        if ratio:
            out["compressed"] = layout.cache_format(self.cache_format(ratio)).page_bytes(self.compressed_page_size(ratio)) / P
        if ratio == 4:
            out["indexer"] = layout.indexer_format(self.index_format).page_bytes(self.compressed_page_size(4)) / P
        out["total"] = sum(out.values())
        return out

    def compressed_page_size(self, ratio: int) -> int:
        """Compressed tokens per page of the ratio-``ratio`` cache (``page_size / ratio``)."""
        return self.page_size // ratio

    def max_blocks(self, ratio: int) -> int:
        """Compressed blocks a request can reach: ``max_seq_len / ratio``."""
        return self.max_seq_len // ratio


def check_cache_fits(config: DeepseekV4Config, cache: CacheConfig) -> None:
    """A cache may hold no position the model has no RoPE for: ``ValueError`` naming both sizes
    where ``cache.max_seq_len > config.max_position_embeddings``."""
    if cache.max_seq_len > config.max_position_embeddings:
        raise ValueError(
            f"CacheConfig.max_seq_len ({cache.max_seq_len}) must be at most the model's "
            f"max_position_embeddings ({config.max_position_embeddings}): positions past it have no RoPE"
        )


def tiny_config(**overrides) -> DeepseekV4Config:
    """A small DSV4 for tests and examples: the Flash RoPE/YaRN numbers, small widths, 4 heads.

    Layers default to one of each kind, ``(0, 4, 128)``. ``head_dim`` stays 512 (the cache layout).
    """
    base = dict(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=64,
        o_lora_rank=64,
        o_groups=2,
        index_n_heads=4,
        index_topk=8,
        max_position_embeddings=4096,
        compress_ratios=(0, 4, 128),
        intermediate_size=128,
    )
    base.update(overrides)
    return DeepseekV4Config(**base)
