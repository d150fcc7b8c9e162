"""The paged KV-cache formats of DeepSeek V4 and V4.1: constants, geometry, allocation, slots,
views, dequantization.

One layer's cache is a **base** ``uint8`` tensor ``[num_pages, page_stride]`` holding ``page_size``
(P) tokens per page; a token is addressed by its **slot** ``page * P + offset`` (``-1``: a hole).
The bytes of a token depend on the cache's :class:`CacheFormat`, which the uint8 tensor cannot say:
the ops take its name (one of :data:`FORMATS`) as ``kv_format`` (default ``"v4"``), and their
providers receive the :class:`CacheFormat` itself.

``"v4"`` (DSV4, 584 bytes per token), block-split: a page holds the P data records, then the P
scale records::

    [0, P*576)            P data records, 576 bytes each:
                              448 float8_e4m3fn values (dims 0..447, scaled)
                              64 bfloat16 values        (dims 448..511, the RoPE dims)
    [P*576, P*576 + P*8)  P scale records, 8 bytes each:
                              7 UE8M0 exponent bytes b (scale 2**(b - 127), one per 64-dim tile)
                              1 pad byte (0)

canonical page stride ``ceil(P*584 / 576) * 576`` (:func:`page_bytes`).

DSV4.1 quantizes all 512 dims (no bf16 part):

* ``"v4.1-fp8"``: 528 bytes per token: 512 float8_e4m3fn values, then 16 UE8M0 bytes (one per 32
  values); ``"v4.1-fp4"``: 288 bytes per token: 512 e2m1 codes two per byte (the even-indexed value
  in the low nibble), then 32 float8_e4m3fn scales (one per 16 values). FP4 serves only as the
  *extra* (compressed) cache next to an FP8 main cache.
* Two arrangements of the same token bytes: **block-split** (``"v4.1-fp8"``, ``"v4.1-fp4"``: the
  P tokens' data, then the P tokens' scales; canonical page stride padded to a multiple of 512 / 256
  bytes, as SGLang allocates them) and **interleaved** (``"v4.1-fp8-interleaved"``,
  ``"v4.1-fp4-interleaved"``: each token's data immediately followed by its scales; canonical
  stride ``P * token_bytes``; what FlashMLA's current kernels read).

Every op accepts any page stride ``>= P * token_bytes`` and takes it from the tensor.
Everything here is plain, traceable PyTorch: Inductor generates and fuses these kernels itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEAD_DIM = 512  # D: the full key / query dimension (V = K)
NOPE_DIM = 448  # dims 0..447: stored as fp8 with per-tile scales (V4)
ROPE_DIM = 64  # dims 448..511: stored as bf16 (V4)
TILE = 64  # width of one quantization tile (V4)
NUM_TILES = NOPE_DIM // TILE  # 7 scale exponents per token (V4)
DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: fp8 values then bf16 RoPE values (V4)
SCALE_BYTES = NUM_TILES + 1  # 8: 7 exponents then one pad byte (V4)
TOKEN_BYTES = DATA_BYTES + SCALE_BYTES  # 584 (V4)
PAGE_ALIGN = DATA_BYTES  # canonical V4 page strides are multiples of 576
#: ``d_qk`` the sparse prefill takes: 512 (DSV4: V is the whole key) and 576 (the V3.2 sparse MLA
#: shape: 512 latent + 64 RoPE dims; V is the first 512).
PREFILL_QK_DIMS = (HEAD_DIM, HEAD_DIM + ROPE_DIM)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_MIN = 1e-4  # V4: amax floor before the scale is computed; V4.1 FP8: floor of amax / 448
UE8M0_BIAS = 127
FP4_MAX = 6.0  # largest e2m1 magnitude
FP4_SCALE_MIN = 2.0**-9  # V4.1 FP4: floor of amax / 6 (the smallest e4m3 subnormal)
#: The records of a V4 token stored from non-finite values: fp8 NaN (0x7F) x 448, bf16 NaN x 64;
#: UE8M0 NaN (0xFF) x 7 and the 0 pad byte. Such a token dequantizes to NaN in every dim.
NAN_DATA_RECORD = torch.cat([
    torch.full((NOPE_DIM,), 0x7F, dtype=torch.uint8),
    torch.tensor([0xC0, 0x7F], dtype=torch.uint8).repeat(ROPE_DIM),
])
NAN_SCALE_RECORD = torch.tensor([0xFF] * NUM_TILES + [0], dtype=torch.uint8)


class _Format:
    """What both kinds of format share: a token is ``data_bytes`` then ``scale_bytes``; one object
    per format, shown as its name and copied or pickled as its name (``_lookup`` resolves it)."""

    @property
    def token_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    def __repr__(self) -> str:
        return repr(self.name)

    def __reduce__(self):
        return type(self)._lookup, (self.name,)


@dataclass(frozen=True, eq=False, repr=False)
class CacheFormat(_Format):
    """One paged KV-cache format: a token's bytes and where they sit in a page.

    ``values``: ``"fp8+bf16"`` (V4), ``"fp8"`` or ``"fp4"`` (V4.1). A token is ``data_bytes`` of
    values then ``scale_bytes`` of scales, one scale per ``group`` values; ``interleaved`` pages
    keep each token's data and scales together, block-split pages hold all data records, then all
    scale records. ``align``: block-split canonical page strides are multiples of it.
    ``nan_data`` / ``nan_scales``: the bytes of a token stored from non-finite values (it
    dequantizes to NaN in every dim).

    There is one object per format (:data:`FORMATS`): compared and hashed by identity, copied and
    pickled as its name, and shown as its name (in errors and provider reports).
    """

    name: str
    values: str
    data_bytes: int
    scale_bytes: int
    group: int
    interleaved: bool
    align: int
    nan_data: tuple[int, ...]
    nan_scales: tuple[int, ...]

    @property
    def is_v4(self) -> bool:
        return self.values == "fp8+bf16"

    def page_bytes(self, page_size: int) -> int:
        """Canonical page stride for ``page_size`` tokens."""
        used = page_size * self.token_bytes
        return used if self.interleaved else -(-used // self.align) * self.align

    def data_offset(self, page_size, offset):
        """Byte offset, within its page, of the data record of token ``offset``."""
        return offset * (self.token_bytes if self.interleaved else self.data_bytes)

    def scale_offset(self, page_size, offset):
        """Byte offset, within its page, of the scale record of token ``offset``."""
        if self.interleaved:
            return offset * self.token_bytes + self.data_bytes
        return page_size * self.data_bytes + offset * self.scale_bytes


V4 = CacheFormat("v4", "fp8+bf16", DATA_BYTES, SCALE_BYTES, TILE, False, PAGE_ALIGN,
                 tuple(NAN_DATA_RECORD.tolist()), tuple(NAN_SCALE_RECORD.tolist()))
_FP8_NAN = ((0x7F,) * HEAD_DIM, (0xFF,) * (HEAD_DIM // 32))  # e4m3 NaN values, UE8M0 NaN scales
_FP4_NAN = ((0x00,) * (HEAD_DIM // 2), (0x7F,) * (HEAD_DIM // 16))  # codes 0, e4m3 NaN scales
V41_FP8 = CacheFormat("v4.1-fp8", "fp8", HEAD_DIM, HEAD_DIM // 32, 32, False, 512, *_FP8_NAN)
V41_FP8_INTERLEAVED = CacheFormat("v4.1-fp8-interleaved", "fp8", HEAD_DIM, HEAD_DIM // 32, 32, True, 528, *_FP8_NAN)
V41_FP4 = CacheFormat("v4.1-fp4", "fp4", HEAD_DIM // 2, HEAD_DIM // 16, 16, False, 256, *_FP4_NAN)
V41_FP4_INTERLEAVED = CacheFormat("v4.1-fp4-interleaved", "fp4", HEAD_DIM // 2, HEAD_DIM // 16, 16, True, 288,
                                  *_FP4_NAN)
#: Every format, by the name the ops take as ``kv_format``.
FORMATS = {f.name: f for f in (V4, V41_FP8, V41_FP8_INTERLEAVED, V41_FP4, V41_FP4_INTERLEAVED)}


def cache_format(kv_format: str | CacheFormat) -> CacheFormat:
    """The :class:`CacheFormat` named ``kv_format`` (one of :data:`FORMATS`), or ``kv_format``
    itself if it is one."""
    if isinstance(kv_format, CacheFormat):
        return kv_format
    fmt = FORMATS.get(kv_format)
    if fmt is None:
        raise ValueError(f"kv_format must be one of {list(FORMATS)}, got {kv_format!r}")
    return fmt


CacheFormat._lookup = staticmethod(cache_format)


def page_bytes(page_size: int, kv_format: str | CacheFormat = "v4") -> int:
    """Canonical page stride in bytes for ``page_size`` tokens of ``kv_format``.

    V4: ``ceil(P*584 / 576) * 576`` (``page_bytes(256) == 149760``, ``page_bytes(64) == 37440``,
    ``page_bytes(2) == 1728``); V4.1 block-split: ``P * 528`` / ``P * 288`` rounded up to a
    multiple of 512 / 256; interleaved: ``P * 528`` / ``P * 288``.
    """
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    return cache_format(kv_format).page_bytes(page_size)


def alloc_cache(
    num_pages: int,
    page_size: int,
    device: torch.device | str | None = None,
    *,
    page_stride: int | None = None,
    kv_format: str | CacheFormat = "v4",
) -> torch.Tensor:
    """Allocate one layer's cache: a zeroed ``uint8 [num_pages, page_stride]`` base tensor.

    ``page_stride`` defaults to :func:`page_bytes` ``(page_size, kv_format)``; any value
    ``>= page_size * token_bytes`` is accepted. Pass this tensor itself (not a view of it) to the
    ``dsv4`` ops, with the same ``kv_format``.
    """
    fmt = cache_format(kv_format)
    stride = page_bytes(page_size, fmt) if page_stride is None else page_stride
    if stride < page_size * fmt.token_bytes:
        raise ValueError(
            f"page_stride must be >= page_size*{fmt.token_bytes}={page_size * fmt.token_bytes} "
            f"({fmt.name}), got {stride}"
        )
    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got {num_pages}")
    return torch.zeros(num_pages, stride, dtype=torch.uint8, device=device)


def capacity(kvcache: torch.Tensor, page_size: int) -> int:
    """Number of slots the cache holds: ``num_pages * page_size``."""
    return kvcache.shape[0] * page_size


def slot(page: torch.Tensor | int, offset: torch.Tensor | int, page_size: int):
    """The slot of token ``offset`` of page ``page``: ``page * page_size + offset``."""
    return page * page_size + offset


def is_power_of_two(page_size: int) -> bool:
    """Whether a page size is a power of two (kernels split a slot by a shift and a mask then)."""
    return page_size > 0 and page_size & (page_size - 1) == 0


def page_and_offset(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split slots into ``(page, offset)``; meaningful for valid (non-negative) slots only."""
    return torch.div(slots, page_size, rounding_mode="floor"), torch.remainder(slots, page_size)


def visible_slots(block_table: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, page_size: int,
                  width: int) -> torch.Tensor:
    """``[n, width]`` int64: the slots of blocks ``0 .. lengths[i] - 1`` of the request whose pages
    are ``block_table[rows[i]]`` (``[R, P]`` page ids; block ``j`` at ``block_table[row, j //
    page_size] * page_size + j % page_size``), ``-1`` past them: the ``block_slots`` of
    ``dsv4::indexer_cache_logits`` (``width <= P * page_size``). Two passes over the output (each
    page's slots as one broadcast sum, then the mask), where splitting every entry into page and
    offset takes about ten."""
    pages = block_table[rows].long() * page_size  # [n, P]
    slots = (pages[:, :, None] + torch.arange(page_size, device=rows.device)).flatten(1)[:, :width]
    k = torch.arange(width, device=rows.device)
    return torch.where(k < lengths[:, None], slots, -1)


def flashmla_view(kvcache: torch.Tensor, page_size: int, kv_format: str | CacheFormat = "v4") -> torch.Tensor:
    """The view FlashMLA's kernels read: ``float8_e4m3fn [num_pages, P, 1, token_bytes]``, page
    stride kept (584 for ``v4``; 528 / 288 for V4.1 FP8 / FP4).

    For block-split formats (V4, and V4.1 as FlashMLA's legacy kernels read it) only the page
    stride and the bytes per token are meaningful in it: the data and scale regions are not
    interleaved per token, the kernels compute their addresses. The interleaved V4.1 view is each
    token's bytes.
    """
    fmt = cache_format(kv_format)
    num_pages, token = kvcache.shape[0], fmt.token_bytes
    return kvcache[:, : page_size * token].view(torch.float8_e4m3fn).view(num_pages, page_size, 1, token)


#: Bytes per token of FlashMLA-style 4-D cache views, and the (block-split) format they name.
VIEW_TOKEN_BYTES = {f.token_bytes: f.name for f in FORMATS.values() if not f.interleaved}


def cache_from_view(view: torch.Tensor, arg: str = "k_cache") -> tuple[torch.Tensor, int, int]:
    """The base cache a FlashMLA-style view ``[num_pages, P, 1, token_bytes]`` (float8_e4m3fn,
    uint8 or int8; ``token_bytes`` 584, 528 or 288) reads, without a copy: ``(uint8 [num_pages,
    page_stride], P, token_bytes)``, the page stride kept. Raises ``ValueError`` (naming ``arg``)
    when the view's geometry cannot be a base cache: another rank or dtype, tokens not packed
    (``stride(1) != token_bytes``), pages overlapping, or the last page's stride running past the
    storage."""
    def fail(expected, got):
        raise ValueError(f"{arg} must be {expected}, got {got}")

    if not isinstance(view, torch.Tensor) or view.dim() != 4 or view.dtype not in (
        torch.float8_e4m3fn, torch.uint8, torch.int8
    ):
        fail("a FlashMLA cache view float8_e4m3fn/uint8/int8 [num_pages, page_size, 1, token_bytes]",
             view if not isinstance(view, torch.Tensor) else f"{str(view.dtype).removeprefix('torch.')} {list(view.shape)}")
    num_pages, page_size, heads, token = view.shape
    if heads != 1 or token not in VIEW_TOKEN_BYTES:
        fail(f"[num_pages, page_size, 1, token_bytes] with token_bytes in {list(VIEW_TOKEN_BYTES)}", list(view.shape))
    stride = view.stride(0)
    if view.stride(3) != 1 or view.stride(1) != token or stride < page_size * token:
        fail(f"tokens packed (strides (>= {page_size * token}, {token}, *, 1)) to be a base cache without a copy",
             f"strides {tuple(view.stride())}")
    # (eager only: Dynamo cannot trace storage queries; a traced view was checked by its eager calls)
    if not torch.compiler.is_compiling() and (
        (view.storage_offset() + num_pages * stride) * view.element_size() > view.untyped_storage().nbytes()
    ):
        fail("pages whose stride stays inside the storage (the last page's padding too) to be a base "
             "cache without a copy", f"{num_pages} pages of {stride} bytes from offset {view.storage_offset()} "
             f"in a {view.untyped_storage().nbytes()}-byte storage")
    base = view.view(torch.uint8).as_strided((num_pages, stride), (stride, 1))
    return base, page_size, token


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` of positive fp32 ``x``, exactly (a power of two stays exact)."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def _ue8m0_to_float(exponent_bytes: torch.Tensor) -> torch.Tensor:
    """Exact ``2**(b - 127)`` for UE8M0 bytes ``b`` in 1..254 (``b`` is the fp32 biased exponent);
    255 gives inf (so a NaN token's values are NaN), 0 gives 0."""
    return (exponent_bytes.to(torch.int32) << 23).view(torch.float32)


def data_records(kvcache: torch.Tensor, page_size: int, kv_format: str | CacheFormat = "v4") -> torch.Tensor:
    """The data records of a base cache as a view ``uint8 [num_pages, P, data_bytes]``."""
    fmt = cache_format(kv_format)
    if fmt.interleaved:
        tokens = kvcache[:, : page_size * fmt.token_bytes].unflatten(1, (page_size, fmt.token_bytes))
        return tokens[:, :, : fmt.data_bytes]
    return kvcache[:, : page_size * fmt.data_bytes].unflatten(1, (page_size, fmt.data_bytes))


def scale_records(kvcache: torch.Tensor, page_size: int, kv_format: str | CacheFormat = "v4") -> torch.Tensor:
    """The scale records of a base cache as a view ``uint8 [num_pages, P, scale_bytes]``."""
    fmt = cache_format(kv_format)
    if fmt.interleaved:
        tokens = kvcache[:, : page_size * fmt.token_bytes].unflatten(1, (page_size, fmt.token_bytes))
        return tokens[:, :, fmt.data_bytes :]
    start = page_size * fmt.data_bytes
    return kvcache[:, start : start + page_size * fmt.scale_bytes].unflatten(1, (page_size, fmt.scale_bytes))


def _e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bytes as fp32 values (exact)."""
    return codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


#: e2m1 magnitudes by 3-bit code: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1(nibbles: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (0..15: sign bit 3) as fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=nibbles.device)
    value = table[(nibbles & 7).long()]
    return torch.where(nibbles >= 8, -value, value)


def dequant_records(data: torch.Tensor, scales: torch.Tensor, kv_format: str | CacheFormat = "v4") -> torch.Tensor:
    """``[n, 512]`` fp32 values of ``n`` tokens from their data and scale records.

    V4: ``fp8 * 2**(b - 127)`` for dims 0..447, the stored bf16 for 448..511. V4.1 FP8:
    ``fp8 * 2**(b - 127)``, one UE8M0 byte ``b`` per 32 values. V4.1 FP4: ``e2m1 * e4m3 scale``, one
    scale per 16 values. Every product is exact (in bf16 too).
    """
    fmt = cache_format(kv_format)
    n = data.shape[0]
    if fmt.is_v4:
        nope = _e4m3(data[:, :NOPE_DIM]).view(n, NUM_TILES, TILE)
        nope = (nope * _ue8m0_to_float(scales[:, :NUM_TILES])[:, :, None]).view(n, NOPE_DIM)
        rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).to(torch.float32)
        return torch.cat([nope, rope], dim=-1)
    if fmt.values == "fp8":
        values, scale = _e4m3(data), _ue8m0_to_float(scales)
    else:  # fp4: the even-indexed value in the low nibble
        values = torch.stack([_e2m1(data & 0xF), _e2m1(data >> 4)], dim=-1).view(n, HEAD_DIM)
        scale = _e4m3(scales)
    return (values.view(n, -1, fmt.group) * scale[:, :, None]).view(n, HEAD_DIM)


def gather_dequant(
    kvcache: torch.Tensor, page_size: int, slots: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
    kv_format: str | CacheFormat = "v4",
) -> torch.Tensor:
    """Dequantize the tokens at ``slots`` (any shape ``S``) of a ``kv_format`` cache into
    ``[*S, 512]`` of ``dtype`` (:func:`dequant_records`; exact in bf16).

    Negative slots (holes) read slot 0's bytes; mask them yourself. Slots must be
    ``< num_pages * page_size``. Reads only the records of ``slots`` (one ``(page, offset)`` pair
    of indices per token, no per-byte index tensors).
    """
    shape = slots.shape
    page, offset = page_and_offset(slots.reshape(-1).clamp_min(0), page_size)
    data = data_records(kvcache, page_size, kv_format)[page, offset]
    scales = scale_records(kvcache, page_size, kv_format)[page, offset]
    return dequant_records(data, scales, kv_format).to(dtype).view(*shape, HEAD_DIM)


def dequant_workspace(
    kvcache: torch.Tensor, page_size: int, slots: torch.Tensor, kv_format: str | CacheFormat = "v4"
) -> torch.Tensor:
    """A bf16 ``[n, 1, 512]`` workspace of the tokens at ``slots [n]`` of a ``kv_format`` cache:
    the sparse-prefill ``kv``. Holes (negative slots) become zero rows."""
    kv = gather_dequant(kvcache, page_size, slots, torch.bfloat16, kv_format)
    kv = torch.where((slots >= 0)[:, None], kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
    return kv.unsqueeze(1)


# --------------------------------------------------------------------------------------------
# The lightning indexer's key cache (docs/design.md §2.11)
# --------------------------------------------------------------------------------------------
#
# One ratio-4 layer's indexer keys, one 128-dim key per compressed block, paged as the c4 cache
# (the same slots: ``page * P + offset`` with P compressed blocks a page). A base ``uint8``
# ``[num_pages, page_stride]`` tensor; every format is block-split: a page holds the P data
# records, then the P scale records (as SGLang's DSV4 pool pages them and DeepGEMM's paged MQA
# logits read them)::
#
#     "fp32"  512 bytes a key: 128 float32 (little-endian); no scale. The exact option.
#     "fp8"   132 bytes a key: [P*128 float8_e4m3fn codes | P*4 float32 scales], value = code * scale
#     "fp4"    68 bytes a key: [P*64 e2m1 codes two per byte (element 2i in the low nibble)
#                              | P*4 UE8M0 bytes, byte g the scale 2^(b-127) of elements 32g..32g+31]
#
# Canonical page stride ``P * token_bytes`` (no padding); every op accepts any stride
# ``>= P * token_bytes`` that is a multiple of 4 (float32 records stay aligned).

INDEX_HEAD_DIM = 128  # DSV4's indexer key width (index_head_dim)
INDEX_SCALE_MIN = 1e-4  # floor of the quantized indexer formats: of amax for FP8, of amax / 6 for FP4 (as SGLang)
INDEX_ALIGN = 4  # index-cache page strides are multiples of it


@dataclass(frozen=True, eq=False, repr=False)
class IndexFormat(_Format):
    """One paged indexer-key format: a key's bytes and where they sit in a page (block-split).

    ``values``: ``"fp32"``, ``"fp8"`` or ``"fp4"``; a key is ``data_bytes`` of values then
    ``scale_bytes`` of scales, one scale per ``group`` values (``0``: none). ``rotated``: whether
    the indexer rotates keys and queries by the normalised Hadamard transform (:func:`hadamard`)
    before quantizing them (the quantized formats: the rotation spreads outlier channels over the
    key, and keeps every dot product, so it changes only the rounding). One object per format
    (:data:`INDEX_FORMATS`), compared by identity and shown as its name, as :class:`CacheFormat`.
    """

    name: str
    values: str
    data_bytes: int
    scale_bytes: int
    group: int
    rotated: bool

    def page_bytes(self, page_size: int) -> int:
        """Canonical page stride for ``page_size`` keys: ``page_size * token_bytes``."""
        return page_size * self.token_bytes


INDEX_FP32 = IndexFormat("fp32", "fp32", 4 * INDEX_HEAD_DIM, 0, 0, False)
INDEX_FP8 = IndexFormat("fp8", "fp8", INDEX_HEAD_DIM, 4, INDEX_HEAD_DIM, True)
INDEX_FP4 = IndexFormat("fp4", "fp4", INDEX_HEAD_DIM // 2, INDEX_HEAD_DIM // 32, 32, True)
#: Every indexer-key format, by the name the ops take as ``index_format``.
INDEX_FORMATS = {f.name: f for f in (INDEX_FP32, INDEX_FP8, INDEX_FP4)}


def indexer_format(name: str | IndexFormat) -> IndexFormat:
    """The :class:`IndexFormat` named ``name`` (one of :data:`INDEX_FORMATS`), or ``name`` itself
    if it is one."""
    if isinstance(name, IndexFormat):
        return name
    fmt = INDEX_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"index_format must be one of {list(INDEX_FORMATS)}, got {name!r}")
    return fmt


IndexFormat._lookup = staticmethod(indexer_format)


def alloc_index_cache(
    num_pages: int, page_size: int, index_format: str | IndexFormat = "fp8", device=None
) -> torch.Tensor:
    """One ratio-4 layer's indexer key cache: a zeroed ``uint8 [num_pages, page_size *
    token_bytes]`` base tensor (``page_size``: compressed blocks a page, the c4 cache's)."""
    fmt = indexer_format(index_format)
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got {num_pages}")
    return torch.zeros(num_pages, fmt.page_bytes(page_size), dtype=torch.uint8, device=device)


def index_records(cache: torch.Tensor, page_size: int, index_format: str | IndexFormat):
    """``(data, scales)``: views ``uint8 [num_pages, P, data_bytes]`` and ``[num_pages, P,
    scale_bytes]`` of an indexer key cache (``scales`` has width 0 for ``"fp32"``)."""
    fmt = indexer_format(index_format)
    data_end = page_size * fmt.data_bytes
    data = cache[:, :data_end].unflatten(1, (page_size, fmt.data_bytes))
    scales = cache[:, data_end : data_end + page_size * fmt.scale_bytes].unflatten(1, (page_size, fmt.scale_bytes))
    return data, scales


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The normalised Walsh-Hadamard transform of the last dim of float32 ``x [..., 128]``:
    ``x @ H / sqrt(128)`` with Sylvester's ``H[i, j] = (-1)^popcount(i & j)`` (symmetric, its own
    inverse). Seven butterfly stages (``(a, b) -> (a + b, a - b)`` over index bits 0..6, in that
    order), then the scale: float32 additions, each rounded once, so the same bits on every
    device and under ``torch.compile``."""
    shape = x.shape
    for bit in range(7):
        pairs = x.reshape(-1, INDEX_HEAD_DIM >> (bit + 1), 2, 1 << bit)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack([a + b, a - b], dim=2)
    return x.reshape(shape) * INDEX_HEAD_DIM**-0.5


def quantize_index(x: torch.Tensor, index_format: str | IndexFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(codes, scales)`` of float32 ``x [..., 128]`` in ``index_format`` (indexer keys, or
    queries per (token, head)); a vector with a non-finite value quantizes to NaN (every value of
    it dequantizes to NaN).

    * ``"fp32"``: ``(x, None)``.
    * ``"fp8"``: ``scale = max(amax, 1e-4) / 448`` (float32), ``codes = e4m3(clamp(x * (1 /
      scale), +-448))`` rounded to nearest even: ``float8_e4m3fn [..., 128]`` and float32
      ``[...]`` (NaN for a non-finite vector).
    * ``"fp4"``: per group of 32 values, ``e = ceil(log2(max(amax / 6, 1e-4)))`` (the floor after the
      division, as SGLang's FP4 indexer quantizer: an all-zero or quiet group gets ``2^-13``) and the e2m1 codes
      of ``x * 2^-e``, nearest, ties toward zero (0, 0.5, 1, 1.5, 2, 3, 4, 6; ``-0`` as ``+0``),
      element ``2i`` in the low nibble: ``uint8 [..., 64]`` and the UE8M0 bytes ``e + 127``,
      ``uint8 [..., 4]`` (a non-finite vector: codes 0, bytes 255).

    Plain traceable PyTorch; the stores' providers write the same bits."""
    fmt = indexer_format(index_format)
    if fmt.values == "fp32":
        return x, None
    finite = torch.isfinite(x).all(-1)
    if fmt.values == "fp8":
        amax = x.abs().amax(-1).clamp_min(INDEX_SCALE_MIN)
        scale = torch.where(finite, amax / FP8_MAX, float("nan"))
        codes = (x * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return codes, scale
    groups = x.unflatten(-1, (INDEX_HEAD_DIM // 32, 32))
    bound = (groups.abs().amax(-1) / FP4_MAX).clamp_min(INDEX_SCALE_MIN).nan_to_num(nan=1.0, posinf=1.0)
    e = ceil_log2(bound)
    a = (groups * _ue8m0_to_float(UE8M0_BIAS - e)[..., None]).abs()  # * 2^-e
    code = (
        (a > 0.25).to(torch.uint8) + (a > 0.75) + (a > 1.25) + (a > 1.75) + (a > 2.5) + (a > 3.5) + (a > 5.0)
    )
    code = code | (((groups < 0) & (code > 0)).to(torch.uint8) << 3)
    code = torch.where(finite[..., None, None], code, 0).flatten(-2)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    exponent = torch.where(finite[..., None], e + UE8M0_BIAS, 255).to(torch.uint8)
    return packed, exponent


def dequant_index(codes: torch.Tensor, scales: torch.Tensor | None, index_format: str | IndexFormat) -> torch.Tensor:
    """float32 ``[..., 128]`` values of :func:`quantize_index`'s ``(codes, scales)`` (or of the
    records read back from a cache: for ``"fp32"`` the 512 bytes, for ``"fp8"`` the 4 scale bytes
    may be given as ``uint8``; ``"fp8"`` codes without scales: the codes' values, as queries whose
    scale the head weights carry). Exact."""
    fmt = indexer_format(index_format)
    if fmt.values == "fp32":
        return codes.contiguous().view(torch.float32) if codes.dtype == torch.uint8 else codes
    if fmt.values == "fp8":
        if scales is None:  # queries whose scale the head weights carry
            return _e4m3(codes.view(torch.uint8))
        if scales.dtype == torch.uint8:
            scales = scales.contiguous().view(torch.float32)[..., 0]
        return _e4m3(codes.view(torch.uint8)) * scales[..., None]
    values = torch.stack([_e2m1(codes & 0xF), _e2m1(codes >> 4)], dim=-1).flatten(-2)
    groups = values.unflatten(-1, (INDEX_HEAD_DIM // 32, 32)) * _ue8m0_to_float(scales)[..., None]
    return groups.flatten(-2)


def gather_index_keys(cache: torch.Tensor, page_size: int, slots: torch.Tensor, index_format) -> torch.Tensor:
    """float32 ``[*S, 128]`` keys at ``slots`` (any shape ``S``, ``>= 0``) of an indexer key cache,
    dequantized (:func:`dequant_index`)."""
    page, offset = page_and_offset(slots.reshape(-1), page_size)
    data, scales = index_records(cache, page_size, index_format)
    return dequant_index(data[page, offset], scales[page, offset], index_format).view(*slots.shape, INDEX_HEAD_DIM)
