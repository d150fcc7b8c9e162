"""The DSV4 ("V4") paged FP8 KV-cache layout: constants, allocation, slots, views, dequantization.

One layer's cache is a **base** ``uint8`` tensor ``[num_pages, page_stride]``. A page holds
``page_size`` (P) tokens in ``P * TOKEN_BYTES`` bytes, split into two regions::

    [0, P*576)            P data records, 576 bytes each:
                              448 float8_e4m3fn values (dims 0..447, scaled)
                              64 bfloat16 values        (dims 448..511, the RoPE dims)
    [P*576, P*576 + P*8)  P scale records, 8 bytes each:
                              7 UE8M0 exponent bytes b (scale 2**(b - 127), one per 64-dim tile)
                              1 pad byte (0)

``page_stride`` may be larger than ``P * 584``; the canonical allocation rounds it up to a multiple
of 576 (:func:`page_bytes`). A token is addressed by its **slot** ``page * P + offset``; slot ``-1``
is a hole.

Everything here is plain, traceable PyTorch: Inductor generates and fuses these kernels itself.
"""

from __future__ import annotations

import torch

HEAD_DIM = 512  # D: the full key / query dimension (V = K)
NOPE_DIM = 448  # dims 0..447: stored as fp8 with per-tile scales
ROPE_DIM = 64  # dims 448..511: stored as bf16
TILE = 64  # width of one quantization tile
NUM_TILES = NOPE_DIM // TILE  # 7 scale exponents per token
DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: fp8 values then bf16 RoPE values
SCALE_BYTES = NUM_TILES + 1  # 8: 7 exponents then one pad byte
TOKEN_BYTES = DATA_BYTES + SCALE_BYTES  # 584
PAGE_ALIGN = DATA_BYTES  # canonical page strides are multiples of 576
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_MIN = 1e-4  # amax floor before the scale is computed
UE8M0_BIAS = 127
#: The records of a token stored from non-finite values: fp8 NaN (0x7F) x 448, bf16 NaN x 64;
#: UE8M0 NaN (0xFF) x 7 and the 0 pad byte. Such a token dequantizes to NaN in every dim.
NAN_DATA_RECORD = torch.cat([
    torch.full((NOPE_DIM,), 0x7F, dtype=torch.uint8),
    torch.tensor([0xC0, 0x7F], dtype=torch.uint8).repeat(ROPE_DIM),
])
NAN_SCALE_RECORD = torch.tensor([0xFF] * NUM_TILES + [0], dtype=torch.uint8)


def page_bytes(page_size: int) -> int:
    """Canonical page stride in bytes for ``page_size`` tokens: ``ceil(P*584 / 576) * 576``.

    ``page_bytes(256) == 149760``, ``page_bytes(64) == 37440``, ``page_bytes(2) == 1728``.
    """
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    return -(-page_size * TOKEN_BYTES // PAGE_ALIGN) * PAGE_ALIGN


def alloc_cache(
    num_pages: int,
    page_size: int,
    device: torch.device | str | None = None,
    *,
    page_stride: int | None = None,
) -> torch.Tensor:
    """Allocate one layer's cache: a zeroed ``uint8 [num_pages, page_stride]`` base tensor.

    ``page_stride`` defaults to :func:`page_bytes` ``(page_size)``; any value ``>= page_size*584``
    is accepted. Pass this tensor itself (not a view of it) to the ``dsv4`` ops.
    """
    stride = page_bytes(page_size) if page_stride is None else page_stride
    if stride < page_size * TOKEN_BYTES:
        raise ValueError(
            f"page_stride must be >= page_size*{TOKEN_BYTES}={page_size * TOKEN_BYTES}, got {stride}"
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


def page_and_offset(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split slots into ``(page, offset)``; meaningful for valid (non-negative) slots only."""
    return torch.div(slots, page_size, rounding_mode="floor"), torch.remainder(slots, page_size)


def flashmla_view(kvcache: torch.Tensor, page_size: int) -> torch.Tensor:
    """The view FlashMLA's kernels read: ``float8_e4m3fn [num_pages, P, 1, 584]``, page stride kept.

    Only the page stride (``stride(0)``) and the 584 bytes per token are meaningful in it: the data
    and scale regions are not interleaved per token, the kernels compute their addresses.
    """
    num_pages = kvcache.shape[0]
    return kvcache[:, : page_size * TOKEN_BYTES].view(torch.float8_e4m3fn).view(
        num_pages, page_size, 1, TOKEN_BYTES
    )


def _ue8m0_to_float(exponent_bytes: torch.Tensor) -> torch.Tensor:
    """Exact ``2**(b - 127)`` for UE8M0 bytes ``b`` in 1..254: ``b`` is the fp32 biased exponent."""
    return (exponent_bytes.to(torch.int32) << 23).view(torch.float32)


def data_records(kvcache: torch.Tensor, page_size: int) -> torch.Tensor:
    """The data records of a base cache as a view ``uint8 [num_pages, P, 576]`` (page stride kept)."""
    return kvcache[:, : page_size * DATA_BYTES].unflatten(1, (page_size, DATA_BYTES))


def scale_records(kvcache: torch.Tensor, page_size: int) -> torch.Tensor:
    """The scale records of a base cache as a view ``uint8 [num_pages, P, 8]`` (page stride kept)."""
    start = page_size * DATA_BYTES
    return kvcache[:, start : start + page_size * SCALE_BYTES].unflatten(1, (page_size, SCALE_BYTES))


def gather_dequant(
    kvcache: torch.Tensor, page_size: int, slots: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dequantize the tokens at ``slots`` (any shape ``S``) into ``[*S, 512]`` of ``dtype``.

    ``value = fp8 * 2**(b - 127)`` for dims 0..447 (exact in bf16: 3 mantissa bits times a power of
    two), the stored bf16 for dims 448..511. Negative slots (holes) read slot 0's bytes; mask them
    yourself. Slots must be ``< num_pages * page_size``. Reads only the records of ``slots`` (one
    ``(page, offset)`` pair of indices per token, no per-byte index tensors).
    """
    shape = slots.shape
    page, offset = page_and_offset(slots.reshape(-1).clamp_min(0), page_size)
    data = data_records(kvcache, page_size)[page, offset]  # [n, 576] uint8
    exps = scale_records(kvcache, page_size)[page, offset, :NUM_TILES]  # [n, 7] uint8
    nope = data[:, :NOPE_DIM].view(torch.float8_e4m3fn).to(torch.float32)
    nope = (nope.view(-1, NUM_TILES, TILE) * _ue8m0_to_float(exps)[:, :, None]).view(-1, NOPE_DIM)
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat([nope, rope], dim=-1).to(dtype).view(*shape, HEAD_DIM)


def dequant_workspace(kvcache: torch.Tensor, page_size: int, slots: torch.Tensor) -> torch.Tensor:
    """A bf16 ``[n, 1, 512]`` workspace of the tokens at ``slots [n]``: the sparse-prefill ``kv``.

    Holes (negative slots) become zero rows.
    """
    kv = gather_dequant(kvcache, page_size, slots, torch.bfloat16)
    kv = torch.where((slots >= 0)[:, None], kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
    return kv.unsqueeze(1)
