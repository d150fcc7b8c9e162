"""Portable Triton kernels for ``dsv4::flash_mla_with_kvcache`` and ``dsv4::flash_mla_sparse_fwd``.

They run wherever Triton runs (NVIDIA Ampere .. Blackwell, AMD, Intel XPU): plain ``tl.dot`` in
bf16 with fp32 accumulation, no fp8 dtype, no architecture-specific instruction. Semantics are the
contract's (docs/design.md §2.3, §2.4) for every head count, page size, page stride, index width and
length; the kernels take the ops' arguments in schema order and return the fakes' geometry.

**Decode** (over the paged caches of every format: V4, layout §2.2; V4.1 FP8 / FP4, block-split
or interleaved, §2.5; the main and the extra cache each in its own format). A program handles one query row
(``b, s``), a block of ``BLOCK_H`` heads and one *split* of that row's keys. MQA: all heads attend
the same keys, so a program gathers and dequantizes a block of ``BLOCK_N`` keys once and multiplies
it with all its heads (``[BLOCK_H, 512] x [512, BLOCK_N]``, then ``P [BLOCK_H, BLOCK_N] x K``).
The keys a row counts -- main entries ``j < min(topk_length, K)``, then extra entries
``j < min(extra_topk_length, K2)``, ``-1`` holes masked -- form one virtual list (the main
entries padded to whole key blocks, so that no block holds keys of both caches), cut into
``num_splits`` equal chunks of whole key blocks; a split walks its part of the main entries, then
its part of the extra ones (each cache with its own page size, stride and format). The lengths
are read in-kernel, so the chunks balance the real work; ``num_splits`` comes from shapes only (about one program per SM, at most
one split per key block), so nothing is read on the host and launches are capture-safe.
The launch geometry is a function of shapes too (:func:`decode_plan`): 64 heads per program on
SM90 / SM100, 32 elsewhere. Where every split holds one key block the key loops are not
software-pipelined, and the extra-cache loop is not pipelined on SM90 / SM100
(:func:`decode_loop_stages`).

Keys are dequantized in registers, exactly (V4.1: an e4m3 value times its UE8M0 scale, or an
e2m1 value times its e4m3 scale, is a bf16 value; V4 as follows)::

    dims 0..447    e4m3fn byte c -> fp32 by the GPU's conversion instruction (NVIDIA SM89+,
                   triton_common.hardware_conversions), elsewhere through the fp16 bits
                   (c & 0x80) << 8 | (c & 0x7F) << 7 (= value * 2^-8, subnormals included); times
                   2^(e - 127) (2^(e - 127 + 8)) built from the tile's UE8M0 byte e (data record
                   at page*S + off*576, scales at page*S + P*576 + off*8); a NaN token (scale
                   bytes 255) is NaN in every dim, as in the reference;
    dims 448..511  two bytes -> bf16 bits (read as bytes: any page stride, odd ones too);

in four power-of-two column pieces (dims 0..255, 256..383, 384..447, 448..511; for V4 the first
three fp8, the last bf16), each multiplied into the scores (``q`` in the same pieces) and then into
its piece of the output, never concatenated: a ``[BLOCK_N, 512]`` tile assembled in registers
spilled on SM90. Softmax is online, fp32, base 2; the weights are rounded
to bf16 for ``P.V`` (as FlashMLA does; tolerances.DEVICE). With one split the program writes
``out``/``lse`` itself; with several, each writes its normalised partial output and base-2
log-sum-exp to an fp32 workspace ``[rows, splits, H, 512]`` and a combine kernel merges them and
applies the sink: ``lse = log sum_i e^{lse_i}``, ``out = sum_i e^{lse_i - lse} o_i *
sigmoid(lse - sink)``; an empty row gives ``out = 0``, ``lse = +inf``.

**Prefill** (over a bf16 workspace ``kv [s_kv, 1, d_qk]``, ``d_qk`` 512, or 576 for the V3.2 shape
whose last 64 dims enter the scores only): one program per (query, head block),
the same online-softmax loop over ``BLOCK_N`` gathered rows of ``kv`` (indices ``< 0`` or
``>= s_kv`` are holes), no split (prefill has queries enough to fill the GPU).

The page size is a *runtime* argument: one compiled kernel serves every page size (deployments use
256 .. 2, FlashMLA's tests 61 and 69; a constexpr would compile a kernel per cache kind and per
size); slot -> (page, offset) is a shift and a mask when the page size is a power of two (the
``POW2`` constexprs, with the shift passed at run time), an integer division per key otherwise
(about 180 more instructions per thread and 64-key block on SM90).

Importing this module imports no Triton: the kernel functions are plain Python until the provider
first loads (:func:`_triton`), as in :mod:`.store`. Under ``torch.compile`` the ops are
decomposed into their Triton launches (a FunctionalTensorMode rule, as :mod:`.store` does
for the store) when this module's kernel serves the op on the device at compile time
(:func:`inlines`), so Inductor sees the launches and allocates their outputs itself.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ... import dispatch, layout
from ...ops.decode import decode_outputs
from ...ops.prefill import prefill_outputs
from .. import reference
from . import common as triton_common

DECODE = "flash_mla_with_kvcache"
PREFILL = "flash_mla_sparse_fwd"
OPS = (DECODE, PREFILL)
LOG2E = math.log2(math.e)
#: The oldest NVIDIA GPUs the attention kernels serve: compiled for SM75, the decode and prefill
#: programs take 102-139 KB of shared memory, against 64 KB per block there (and 96 KB on SM70).
MIN_CAPABILITY = (8, 0)
#: Most splits of one row's keys in decode (bounds the workspace and the combine loop).
MAX_SPLITS = 32


@dataclass(frozen=True)
class Config:
    """Launch geometry: heads and keys per program step, warps, software-pipeline stages
    (``extra_stages``: of the decode's extra-cache loop, None for ``num_stages``; see
    :func:`decode_loop_stages`). ``shared_bytes``: the most shared memory a program takes, as
    Triton 3.6 compiles it for the NVIDIA GPUs that get the geometry (the prefill's, over 512- and
    576-dim queries; ``tests/test_triton_compile.py`` checks it); None where not recorded."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    extra_stages: int | None = None
    shared_bytes: int | None = None

    def __post_init__(self):
        # 16-key blocks gave wrong decode results on the H200 (Triton 3.6, SM90) while 32 and up
        # matched the reference and the interpreter: keep key blocks at 32 or more until
        # scripts/repro_triton_16key_decode.py shows them right (benchmarks/RESULTS.md).
        if self.block_n < 32 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 32, got {self.block_n}")


#: Decode on NVIDIA SM90 (warpgroup MMA): 64 heads x 64 keys per step, 1 program of 8 warps
#: per SM (the fastest of the H200 sweep at T >= 8: benchmarks/history/RESULTS-notebook.md). The
#: extra-cache loop is not pipelined: with two stages the decode took 1.10x the time at T = 64 and
#: 1.07x at T = 256 on the H200 (1.25x at T = 64 when the loop still hoisted and spilled).
DECODE_CONFIG = Config(block_h=64, block_n=64, num_warps=8, num_stages=2, extra_stages=1)
#: Decode elsewhere (SM80/86/89/100/120; AMD, Intel): 32 heads per program, as 64 spill ~0.9 KB
#: per thread on SM80 (ptxas), and on SM100 64-head programs take 544 tensor-memory columns of the
#: SM's 512, which Triton 3.6 compiles to a bare trap (``tests/test_triton_compile.py``). Compiled
#: for the H200 it takes 1.2x (T = 1) to 3.4x (T = 256) SM90's time: 32-row programs cannot use
#: the warpgroup MMA there (benchmarks/RESULTS.md, "Triton decode vs FlashMLA").
DECODE_CONFIG_SMALL = Config(block_h=32, block_n=32, num_warps=8, num_stages=2)
#: Prefill on SM90: 64 keys per step (1.6x the 32-key geometry on the H200).
PREFILL_CONFIG = Config(block_h=64, block_n=64, num_warps=8, num_stages=2, shared_bytes=221_440)
#: Prefill on SM100: Triton's SM100 code keeps MMA operands in shared memory, where the SM90
#: geometry needs 345 KB (227 KB per block there). One stage of 64 keys fits; on the H200 it took
#: 1.16x the two-stage time and beat 32-key steps. Not timed on an SM100 GPU.
PREFILL_CONFIG_SM100 = Config(block_h=64, block_n=64, num_warps=8, num_stages=1, shared_bytes=147_464)
#: Prefill on other GPUs: 32 keys per step, no spills on SM80 (163 KB of shared memory per program);
#: 1.57x SM90's time on the H200.
PREFILL_CONFIG_SMALL = Config(block_h=64, block_n=32, num_warps=8, num_stages=2, shared_bytes=115_840)
#: Prefill where a program may take less shared memory than :data:`PREFILL_CONFIG_SMALL` needs
#: (NVIDIA SM86, SM89, SM120: 99 KB): 32 heads per program, no spills on SM80 / SM89 / SM120 (ptxas).
#: With 64 heads each query's keys are gathered twice, once per head block (2.96x SM90's time
#: on the H200, where 32-row programs cannot use the warpgroup MMA).
PREFILL_CONFIG_LOW_SHARED = Config(block_h=32, block_n=32, num_warps=8, num_stages=2, shared_bytes=76_416)
#: The combine kernel's tile: heads x output columns per program (H200, 64 heads: 8 x 128 took
#: 0.3-0.4 us less than 16 x 128 at T = 1 and 8, the same at T = 64; pipelining its loop over the
#: splits did not help).
COMBINE_BLOCK_H, COMBINE_BLOCK_D = 8, 128
#: Fewest keys a decode split should hold: a split costs a ``[H, 512]`` fp32 partial output
#: written and read back (128 KB for 64 heads, the bytes of ~220 cache keys), so splitting a row's
#: 640 keys into 20 tiny splits would move more partial data than keys.
MIN_SPLIT_KEYS = 64
#: Most query rows a decode launch orders longest first (:func:`decode_order`): every program
#: ranks all rows' lengths, O(rows) work each.
ORDER_MAX_ROWS = 4096


def _geometry_capability(device: torch.device) -> tuple[int, int] | None:
    """The NVIDIA compute capability whose launch geometries ``device`` takes: SM90's in the
    interpreter (CPU tensors), else :func:`.common.nvidia_capability` (None: not an NVIDIA
    GPU)."""
    return (9, 0) if device.type == "cpu" else triton_common.nvidia_capability(device)


def decode_config(device: torch.device) -> Config:
    """The decode launch geometry for ``device`` (``block_h`` is then capped by the head count):
    :data:`DECODE_CONFIG` on SM90 (and in the interpreter), :data:`DECODE_CONFIG_SMALL` elsewhere."""
    capability = _geometry_capability(device)
    return DECODE_CONFIG if capability and capability[0] == 9 else DECODE_CONFIG_SMALL


def prefill_config(device: torch.device) -> Config:
    """The prefill launch geometry for ``device``: :data:`PREFILL_CONFIG` on SM90 (and in the
    interpreter), :data:`PREFILL_CONFIG_SM100` on SM100; elsewhere :data:`PREFILL_CONFIG_SMALL`, or
    :data:`PREFILL_CONFIG_LOW_SHARED` where a program may take less shared memory than it needs
    (:func:`.common.shared_memory_per_block`)."""
    capability = _geometry_capability(device)
    major = capability[0] if capability else None
    if major == 9:
        return PREFILL_CONFIG
    if major == 10:
        return PREFILL_CONFIG_SM100
    limit = triton_common.shared_memory_per_block(device)
    if limit is not None and limit < PREFILL_CONFIG_SMALL.shared_bytes:
        return PREFILL_CONFIG_LOW_SHARED
    return PREFILL_CONFIG_SMALL


def _block_h(config: Config, heads: int) -> int:
    """Heads per program: ``config.block_h`` capped by ``heads`` rounded up to a power of two, >= 16."""
    heads = int(heads)  # a symbolic head count is specialised (guarded): it sizes the launch
    return max(16, min(config.block_h, 1 << (max(heads, 1) - 1).bit_length()))


# --------------------------------------------------------------------------------------------
# The Triton code: plain functions and numbers until _triton() jits them and makes them constexprs.
# --------------------------------------------------------------------------------------------

triton = tl = None  # bound by _triton()
_NOPE, _ROPE, _D, _TILE = layout.NOPE_DIM, layout.ROPE_DIM, layout.HEAD_DIM, layout.TILE
_DATA_BYTES, _SCALE_BYTES, _LN2, _LOG2E = layout.DATA_BYTES, layout.SCALE_BYTES, math.log(2.0), LOG2E
_C0, _C1, _C2, _C3 = 0, 256, 384, 448  # the key's column pieces: [0, 256) [256, 384) [384, 448) [448, 512)
_CONSTEXPRS = (
    "_NOPE", "_ROPE", "_D", "_TILE", "_DATA_BYTES", "_SCALE_BYTES", "_LN2", "_LOG2E", "_C0", "_C1", "_C2", "_C3",
)


def _records(
    cache_ptr, slot, page_size, page_shift, page_stride,
    DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, INTERLEAVED: tl.constexpr, POW2: tl.constexpr,
):
    """Byte pointers of the data and scale records of ``slot`` (valid slots) in a paged cache whose
    tokens are ``DATA_BYTES`` then ``SCALE_BYTES``, block-split or ``INTERLEAVED``. ``POW2``: the
    page size is ``2^page_shift`` (a shift and a mask instead of an integer division)."""
    if POW2:
        page = slot >> page_shift
        offset = (slot & (page_size - 1)).to(tl.int64)
    else:
        page = slot // page_size
        offset = (slot - page * page_size).to(tl.int64)
    base = cache_ptr + page.to(tl.int64) * page_stride
    if INTERLEAVED:
        data = base + offset * (DATA_BYTES + SCALE_BYTES)
        return data, data + DATA_BYTES
    return base + offset * DATA_BYTES, base + page_size * DATA_BYTES + offset * SCALE_BYTES


def _e4m3_values(code, HW: tl.constexpr):
    """float8_e4m3fn codes (uint8) as fp32 values, exactly: ``HW``, by the GPU's conversion
    instruction; else through fp16 bits, as the value times ``2^-8`` (which :func:`_ue8m0_scale`
    and :func:`_e4m3_scale` undo) and 480 * 2^-8 for the NaN codes 0x7F / 0xFF, whose tokens'
    scales carry the NaN there (:data:`~dsv4_compile.layout.NAN_SCALE_RECORD`)."""
    if HW:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    code = code.to(tl.int32)
    half = (((code & 0x80) << 8) | ((code & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32)


def _ue8m0_scale(e, HW: tl.constexpr):
    """UE8M0 bytes ``e`` (uint8) as the factor of :func:`_e4m3_values`' values (``HW`` alike):
    ``2^(e - 127)`` as the reference reads it (0 for ``e = 0``, inf for the NaN byte 255);
    without ``HW`` times ``2^8``, NaN for 255, and inf for 247..254 (factors of ``2^120`` and up,
    past what a store of finite fp32 values writes)."""
    e = e.to(tl.int32)
    if HW:
        return (e << 23).to(tl.float32, bitcast=True)
    scale = tl.where(e < 247, ((e + 8) << 23).to(tl.float32, bitcast=True), float("inf"))
    return tl.where(e == 0, 0.0, tl.where(e == 255, float("nan"), scale))


def _e4m3_scale(code, HW: tl.constexpr):
    """e4m3 scale bytes (uint8) as fp32 values, exactly: NaN for the NaN codes 0x7F / 0xFF."""
    if HW:
        return _e4m3_values(code, HW)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), _e4m3_values(code, HW) * 256.0)


def _e2m1_values(code):
    """e2m1 codes (int32 0..15, bit 3 the sign) as fp32 values times 2^-14, exactly: the three
    magnitude bits as an fp16's bits 11..9 (exponent low bits and the mantissa's top bit) and the
    sign as bit 15 read 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2^-14 (0.5: the subnormal 2^-15),
    as the integer fp8 path does for e4m3 (:func:`_e4m3_values`)."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


def _fp8_piece(
    data, scales, valid, OFF: tl.constexpr, WIDTH: tl.constexpr, GROUP: tl.constexpr, HW: tl.constexpr,
):
    """Dims ``OFF .. OFF+WIDTH`` of keys stored as e4m3 values, one UE8M0 scale per ``GROUP``
    values (V4 dims 0..447: 64; V4.1 FP8: 32), whose data / scale records start at the byte
    pointers ``data`` / ``scales [BN]``: ``[BN, WIDTH]`` bf16, exact; 0 where not ``valid``."""
    code = tl.load(data[:, None] + (tl.arange(0, WIDTH) + OFF)[None, :], mask=valid[:, None], other=0)
    g = tl.arange(0, WIDTH // GROUP) + OFF // GROUP
    e = tl.load(scales[:, None] + g[None, :], mask=valid[:, None], other=0)
    value = tl.reshape(_e4m3_values(code, HW), (data.shape[0], WIDTH // GROUP, GROUP))
    value = value * _ue8m0_scale(e, HW)[:, :, None]
    return tl.reshape(value, (data.shape[0], WIDTH)).to(tl.bfloat16)


def _bf16_piece(data, valid):
    """V4 dims 448..511 (the bf16 RoPE values) of the keys at ``data``: ``[BN, 64]`` bf16.
    Read as bytes, so any page stride (odd ones too) is fine."""
    b = tl.arange(0, 2 * _ROPE)
    byte = tl.load(data[:, None] + (b + _NOPE)[None, :], mask=valid[:, None], other=0)
    lo, hi = tl.split(tl.reshape(byte.to(tl.int32), (data.shape[0], _ROPE, 2)))
    return (lo | (hi << 8)).to(tl.int16).to(tl.bfloat16, bitcast=True)


def _fp4_piece(data, scales, valid, OFF: tl.constexpr, WIDTH: tl.constexpr, HW: tl.constexpr):
    """V4.1 FP4 dims ``OFF .. OFF+WIDTH``: e2m1 values (two per byte, the even one in the low
    nibble) times their e4m3 scale (one per 16): ``[BN, WIDTH]`` bf16, exact."""
    b = tl.arange(0, WIDTH // 2) + OFF // 2
    byte = tl.load(data[:, None] + b[None, :], mask=valid[:, None], other=0).to(tl.int32)
    code = tl.reshape(tl.join(byte & 0xF, byte >> 4), (data.shape[0], WIDTH))  # value 2i, 2i+1
    g = tl.arange(0, WIDTH // 16) + OFF // 16
    scale = _e4m3_scale(tl.load(scales[:, None] + g[None, :], mask=valid[:, None], other=0), HW) * 16384.0
    value = tl.reshape(_e2m1_values(code), (data.shape[0], WIDTH // 16, 16)) * scale[:, :, None]  # 2^-14 * 2^14
    return tl.reshape(value, (data.shape[0], WIDTH)).to(tl.bfloat16)


def _piece(data, scales, valid, OFF: tl.constexpr, WIDTH: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    """Dims ``OFF .. OFF+WIDTH`` of the keys at ``data`` / ``scales`` of a format-``FMT`` cache
    (0: V4, 1: V4.1 FP8, 2: V4.1 FP4): ``[BN, WIDTH]`` bf16, exact; a V4 piece lies within dims
    0..447 (fp8) or is dims 448..511 (bf16)."""
    if FMT == 0:
        if OFF == _NOPE:
            return _bf16_piece(data, valid)
        return _fp8_piece(data, scales, valid, OFF, WIDTH, _TILE, HW)
    elif FMT == 1:
        return _fp8_piece(data, scales, valid, OFF, WIDTH, 32, HW)
    else:
        return _fp4_piece(data, scales, valid, OFF, WIDTH, HW)


def _online_softmax(s, valid, m, l, scale_log2):
    """One step of the online softmax over scores ``s [BH, BN]`` (raw dot products): returns
    the bf16 weights ``p``, the rescale ``alpha`` of what was accumulated, new ``m`` and ``l``
    (base 2: ``m`` the running max of ``scale*log2(e)*s``, ``l = sum 2^(s2 - m)``)."""
    s = tl.where(valid[None, :], s * scale_log2, -float("inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # no key yet: keep everything 0
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return p.to(tl.bfloat16), alpha, m_new, l * alpha + tl.sum(p, 1)


def _attend(
    acc0, acc1, acc2, acc3, m, l, q0, q1, q2, q3, j0, j1, scale_log2,
    cache_ptr, page_size, page_shift, page_stride, idx_ptr, idx_stride,
    FMT: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, INTERLEAVED: tl.constexpr,
    POW2: tl.constexpr, BLOCK_N: tl.constexpr, HW: tl.constexpr, STAGES: tl.constexpr,
):
    """Accumulate the keys of index entries ``[j0, j1)`` of one cache: format ``FMT`` (0: V4,
    1: V4.1 FP8, 2: V4.1 FP4), tokens of ``DATA_BYTES`` then ``SCALE_BYTES``, ``INTERLEAVED`` or
    block-split pages of ``page_size`` (``2^page_shift`` if ``POW2``) tokens. Queries, keys and
    outputs in the four column pieces ``_C0 .. _C3``: each key piece is dequantized, multiplied
    into the scores and later into its output piece, and never concatenated with the others
    (a whole ``[BN, 512]`` tile in registers spilled on SM90). Nothing is hoisted out of the loop
    (``disable_licm``): hoisted, the MMAs' shared-memory descriptors and the per-block address
    terms lived across the loop, were spilled (664 stack bytes per thread on SM90) and reloaded
    every block; recomputed, nothing spills and a block issues 11-12% fewer instructions (SM90;
    H200: 1.18-1.23x the decode at T = 8 .. 256). Each block's index entries are loaded one block
    ahead, so a block does not start by waiting for them."""
    j = j0 + tl.arange(0, BLOCK_N)
    ahead = tl.load(idx_ptr + j * idx_stride, mask=j < j1, other=-1)
    for b0 in tl.range(j0, j1, BLOCK_N, num_stages=STAGES, disable_licm=True):
        slot = ahead
        j = b0 + BLOCK_N + tl.arange(0, BLOCK_N)
        ahead = tl.load(idx_ptr + j * idx_stride, mask=j < j1, other=-1)
        valid = slot >= 0  # -1: a hole (other negatives are undefined: skipped too)
        slot = tl.where(valid, slot, 0)
        data, scales = _records(
            cache_ptr, slot, page_size, page_shift, page_stride, DATA_BYTES, SCALE_BYTES, INTERLEAVED, POW2,
        )
        k0 = _piece(data, scales, valid, _C0, _C1 - _C0, FMT, HW)
        k1 = _piece(data, scales, valid, _C1, _C2 - _C1, FMT, HW)
        k2 = _piece(data, scales, valid, _C2, _C3 - _C2, FMT, HW)
        k3 = _piece(data, scales, valid, _C3, _D - _C3, FMT, HW)
        scores = tl.dot(q3, tl.trans(k3), tl.dot(q2, tl.trans(k2), tl.dot(q1, tl.trans(k1), tl.dot(q0, tl.trans(k0)))))
        p, alpha, m, l = _online_softmax(scores, valid, m, l, scale_log2)
        acc0 = tl.dot(p, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(p, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(p, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(p, k3, acc3 * alpha[:, None])
    return acc0, acc1, acc2, acc3, m, l


def _lse2_and_inverse(m, l):
    """Base-2 ``lse = m + log2(l)`` (-inf where no key counted, ``l = 0``) and ``1 / l`` (0 there);
    NaN both where a NaN score made ``l`` NaN."""
    empty = l == 0
    safe = tl.where(empty, 1.0, l)
    return tl.where(empty, -float("inf"), m + tl.log2(safe)), tl.where(empty, 0.0, 1.0 / safe)


def _sink_and_lse(lse2, sink_ptr, sink_stride, h, h_mask, HAS_SINK: tl.constexpr):
    """From the base-2 log-sum-exp ``lse2 [BH]`` (-inf: no key): the factor ``out`` gets
    (``1 / (1 + e^(sink - lse))``; 0 for an empty row) and the natural ``lse`` (+inf if empty)."""
    empty = lse2 == -float("inf")
    factor = tl.where(empty, 0.0, 1.0)
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + h * sink_stride, mask=h_mask, other=0.0) * _LOG2E
        factor = tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp2(sink2 - tl.where(empty, 0.0, lse2))))
    return factor, tl.where(empty, float("inf"), lse2 * _LN2)


def _final_factor(lse_at, lse2, inv_l, sink_ptr, sink_stride, h, h_mask, HAS_SINK: tl.constexpr, lse_mask):
    """Store the natural ``lse`` at the pointers ``lse_at`` where ``lse_mask``; return the factor
    of the accumulated output: ``out = acc * inv_l * sigmoid(lse - sink)``."""
    factor, lse = _sink_and_lse(lse2, sink_ptr, sink_stride, h, h_mask, HAS_SINK)
    tl.store(lse_at, lse, mask=lse_mask)
    return inv_l * factor


def _store_columns(ptr, at, d, h_mask, value):
    """``value [BH, len(d)]`` at columns ``d`` of the 512-wide rows at flat index ``at``."""
    tl.store(ptr + at[:, None] * _D + d[None, :], value.to(ptr.dtype.element_ty), mask=h_mask[:, None])


def _store_pieces(ptr, at, h_mask, acc0, acc1, acc2, acc3, factor):
    """The four column pieces of :func:`_attend`'s output, times ``factor [BH]``."""
    _store_columns(ptr, at, tl.arange(0, _C1 - _C0) + _C0, h_mask, acc0 * factor[:, None])
    _store_columns(ptr, at, tl.arange(0, _C2 - _C1) + _C1, h_mask, acc1 * factor[:, None])
    _store_columns(ptr, at, tl.arange(0, _C3 - _C2) + _C2, h_mask, acc2 * factor[:, None])
    _store_columns(ptr, at, tl.arange(0, _D - _C3) + _C3, h_mask, acc3 * factor[:, None])


def _store_final(
    out_ptr, lse_at, at, d, h, h_mask, acc, lse2, inv_l, sink_ptr, sink_stride, HAS_SINK: tl.constexpr, lse_mask,
):
    """``out = acc * inv_l * sigmoid(lse - sink)`` at flat (row, head) ``at``, columns ``d``; the
    natural ``lse`` at the pointers ``lse_at`` where ``lse_mask``."""
    factor = _final_factor(lse_at, lse2, inv_l, sink_ptr, sink_stride, h, h_mask, HAS_SINK, lse_mask)
    _store_columns(out_ptr, at, d, h_mask, acc * factor[:, None])


def _counted(n, x_n, width, x_width, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_X_LEN: tl.constexpr):
    """The counted entries ``[0, n)`` of the main indices and ``[0, x_n)`` of the extra ones, from
    the lengths ``n`` / ``x_n`` as loaded (read only where ``HAS_LEN`` / ``HAS_X_LEN``; scalars or
    vectors). The loads stay in the kernel: a pointer passed to a function on the way to a store's
    address reads to torch's mutation analysis as written."""
    if HAS_LEN:
        n = tl.minimum(tl.maximum(n, 0), width)
    else:
        n = width
    if HAS_EXTRA:
        if HAS_X_LEN:
            x_n = tl.minimum(tl.maximum(x_n, 0), x_width)
        else:
            x_n = x_width
    else:
        x_n = 0
    return n, x_n


def _longest_first(p, blocks, live, BINS: tl.constexpr):
    """The row of rank ``p`` when the rows (``live`` entries of ``blocks``, each row's key block
    count ``< BINS``) are ordered by their block counts, most first, ties by row: a counting sort,
    which each program runs for itself (O(rows), no launch, no sync)."""
    key = (BINS - 1) - blocks  # ascending: most blocks first
    count = tl.histogram(key, BINS, mask=live)
    before = tl.cumsum(count, 0) - count  # rows of smaller keys
    here = (before <= p) & (p < before + count)
    k = tl.sum(tl.where(here, tl.arange(0, BINS), 0), 0)
    nth = p - tl.sum(tl.where(here, before, 0), 0)
    same = live & (key == k)
    rank = tl.cumsum(same.to(tl.int32), 0)
    return tl.sum(tl.where(same & (rank == nth + 1), tl.arange(0, blocks.shape[0]), 0), 0)


def _decode_kernel(
    q_ptr, q_sb, q_ss, q_sh, q_sd,
    cache_ptr, page_size, page_shift, page_stride, idx_ptr, idx_sb, idx_ss, idx_sj, width, len_ptr, len_sb,
    x_cache_ptr, x_page_size, x_page_shift, x_page_stride, x_idx_ptr, x_idx_sb, x_idx_ss, x_idx_sj, x_width,
    x_len_ptr, x_len_sb,
    sink_ptr, sink_stride, out_ptr, lse_ptr, lse_sb, lse_ss, lse_sh, part_ptr, part_lse_ptr,
    rows, s_q, heads, num_splits, wave, scale_log2,
    HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_X_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, INTERLEAVED: tl.constexpr,
    POW2: tl.constexpr, X_FMT: tl.constexpr, X_DATA_BYTES: tl.constexpr, X_SCALE_BYTES: tl.constexpr,
    X_INTERLEAVED: tl.constexpr, X_POW2: tl.constexpr, HW: tl.constexpr, STAGES: tl.constexpr,
    X_STAGES: tl.constexpr, ORDER: tl.constexpr, ORDER_ROWS: tl.constexpr, ORDER_BINS: tl.constexpr,
):
    """Program (row, head block, split). ``PARTIAL`` 1: write the normalised partial output and
    base-2 lse to the workspace ``[rows, num_splits, heads, (512)]``; 0: the final outputs;
    2: decide at run time (``num_splits > 1``), for a split count that is symbolic when traced.
    ``POW2`` / ``X_POW2``: the main / extra page size is a power of two (``2^page_shift``);
    ``HW``: fp8 by conversion instructions (:func:`.common.hardware_conversions`).
    ``ORDER`` (:func:`decode_order`) 1: program ``i`` takes the row of rank ``i`` longest first;
    2: so if at run time one split per row leaves more rows than one ``wave`` of programs."""
    scale_log2 = tl.cast(scale_log2, tl.float32)  # Inductor's launcher passes Python floats as fp64
    row = tl.program_id(0)
    # constexpr for ORDER 0 / 1 (the `or` / `and` short-circuit on them), a run-time test for 2
    if ORDER == 1 or (ORDER == 2 and ((num_splits == 1) & (rows > wave) & (rows <= ORDER_ROWS))):
        r = tl.arange(0, ORDER_ROWS)
        live = r < rows
        n_r, x_n_r = _counted(tl.load(len_ptr + (r // s_q) * len_sb, mask=live & HAS_LEN, other=0),
                              tl.load(x_len_ptr + (r // s_q) * x_len_sb, mask=live & HAS_X_LEN, other=0),
                              width, x_width, HAS_LEN, HAS_EXTRA, HAS_X_LEN)
        row = _longest_first(row, tl.cdiv(n_r, BLOCK_N) + tl.cdiv(x_n_r, BLOCK_N), live, ORDER_BINS)
    split = tl.program_id(2)
    b = row // s_q
    s = row - b * s_q
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < heads
    q_row = q_ptr + b.to(tl.int64) * q_sb + s.to(tl.int64) * q_ss + h[:, None] * q_sh
    q0 = tl.load(q_row + (tl.arange(0, _C1 - _C0) + _C0)[None, :] * q_sd, mask=h_mask[:, None], other=0.0)
    q1 = tl.load(q_row + (tl.arange(0, _C2 - _C1) + _C1)[None, :] * q_sd, mask=h_mask[:, None], other=0.0)
    q2 = tl.load(q_row + (tl.arange(0, _C3 - _C2) + _C2)[None, :] * q_sd, mask=h_mask[:, None], other=0.0)
    q3 = tl.load(q_row + (tl.arange(0, _D - _C3) + _C3)[None, :] * q_sd, mask=h_mask[:, None], other=0.0)

    # the row's counted entries: [0, n) of the main indices, then [0, x_n) of the extra ones
    n, x_n = _counted(tl.load(len_ptr + b * len_sb, mask=HAS_LEN, other=0),
                      tl.load(x_len_ptr + b * x_len_sb, mask=HAS_X_LEN, other=0),
                      width, x_width, HAS_LEN, HAS_EXTRA, HAS_X_LEN)
    # the virtual list: the main entries padded to whole key blocks, then the extra ones, so that
    # every key block of a split lies in one cache (no split pays a partial block on both sides)
    n_pad = tl.cdiv(n, BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(n_pad + x_n, num_splits), BLOCK_N) * BLOCK_N
    v0 = split * chunk
    v1 = tl.minimum(v0 + chunk, n_pad + x_n)

    acc0 = tl.zeros((BLOCK_H, _C1 - _C0), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_H, _C2 - _C1), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_H, _C3 - _C2), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_H, _D - _C3), dtype=tl.float32)
    m = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    idx_row = idx_ptr + b.to(tl.int64) * idx_sb + s.to(tl.int64) * idx_ss
    x_idx_row = x_idx_ptr + b.to(tl.int64) * x_idx_sb + s.to(tl.int64) * x_idx_ss
    # the split's part of the main entries, then of the extra ones (each cache has its own format)
    acc0, acc1, acc2, acc3, m, l = _attend(
        acc0, acc1, acc2, acc3, m, l, q0, q1, q2, q3, v0, tl.minimum(v1, n), scale_log2,
        cache_ptr, page_size, page_shift, page_stride, idx_row, idx_sj,
        FMT, DATA_BYTES, SCALE_BYTES, INTERLEAVED, POW2, BLOCK_N, HW, STAGES,
    )
    if HAS_EXTRA:
        acc0, acc1, acc2, acc3, m, l = _attend(
            acc0, acc1, acc2, acc3, m, l, q0, q1, q2, q3, tl.maximum(v0, n_pad) - n_pad, v1 - n_pad, scale_log2,
            x_cache_ptr, x_page_size, x_page_shift, x_page_stride, x_idx_row, x_idx_sj,
            X_FMT, X_DATA_BYTES, X_SCALE_BYTES, X_INTERLEAVED, X_POW2, BLOCK_N, HW, X_STAGES,
        )

    lse2, inv_l = _lse2_and_inverse(m, l)
    part_at = (row.to(tl.int64) * num_splits + split) * heads + h
    out_at = row.to(tl.int64) * heads + h
    lse_at = lse_ptr + b.to(tl.int64) * lse_sb + s.to(tl.int64) * lse_ss + h * lse_sh
    # several splits: the split's normalised output acc / l and base-2 lse; one: the final outputs
    partial = PARTIAL == 1
    if PARTIAL == 2:
        partial = num_splits > 1
    if partial:
        tl.store(part_lse_ptr + part_at, lse2, mask=h_mask)
        _store_pieces(part_ptr, part_at, h_mask, acc0, acc1, acc2, acc3, inv_l)
    else:
        factor = _final_factor(lse_at, lse2, inv_l, sink_ptr, sink_stride, h, h_mask, HAS_SINK, h_mask)
        _store_pieces(out_ptr, out_at, h_mask, acc0, acc1, acc2, acc3, factor)


def _combine(
    part_ptr, part_lse_ptr, sink_ptr, sink_stride, out_ptr, lse_ptr, lse_sb, lse_ss, lse_sh,
    s_q, heads, num_splits, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Columns ``BLOCK_D * program_id(2) ..`` of one row's head block, and its lse:
    ``lse = log sum_i e^{lse_i}``, ``out = sum_i e^{lse_i - lse} o_i * sigmoid(lse - sink)``."""
    row = tl.program_id(0)
    b = row // s_q
    s = row - b * s_q
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < heads
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    first = row.to(tl.int64) * num_splits * heads + h  # split 0's entry of each head
    top = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    for i in range(num_splits):
        top = tl.maximum(top, tl.load(part_lse_ptr + first + i * heads, mask=h_mask, other=-float("inf")))
    ref = tl.where(top == -float("inf"), 0.0, top)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for i in range(num_splits):
        w = tl.exp2(tl.load(part_lse_ptr + first + i * heads, mask=h_mask, other=-float("inf")) - ref)
        o = tl.load(part_ptr + (first + i * heads)[:, None] * _D + d[None, :], mask=h_mask[:, None], other=0.0)
        total += w
        acc += w[:, None] * o
    lse2, inv_total = _lse2_and_inverse(ref, total)
    lse_at = lse_ptr + b.to(tl.int64) * lse_sb + s.to(tl.int64) * lse_ss + h * lse_sh
    _store_final(out_ptr, lse_at, row.to(tl.int64) * heads + h, d, h, h_mask, acc, lse2, inv_total,
                 sink_ptr, sink_stride, HAS_SINK, h_mask & (tl.program_id(2) == 0))


def _combine_kernel(
    part_ptr, part_lse_ptr, sink_ptr, sink_stride, out_ptr, lse_ptr, lse_sb, lse_ss, lse_sh,
    s_q, heads, num_splits, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (row, head block, column block): merge the row's ``num_splits`` partial results
    (nothing to do for one split: the decode kernel wrote the outputs)."""
    if num_splits > 1:
        _combine(part_ptr, part_lse_ptr, sink_ptr, sink_stride, out_ptr, lse_ptr, lse_sb, lse_ss, lse_sh,
                 s_q, heads, num_splits, HAS_SINK, BLOCK_H, BLOCK_D)


def _prefill_kernel(
    q_ptr, q_ss, q_sh, q_sd, kv_ptr, kv_s, kv_sd, s_kv, idx_ptr, idx_ss, idx_sj, width,
    len_ptr, len_s, sink_ptr, sink_stride, out_ptr, max_logits_ptr, lse_ptr, heads, scale_log2,
    HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    ROPE_QK: tl.constexpr,
):
    """Program (query, head block) over the query's counted indices into ``kv``. ``ROPE_QK``: the
    V3.2 shape, ``d_qk = 576``: 64 more dims (512..575) enter the scores, not the output."""
    scale_log2 = tl.cast(scale_log2, tl.float32)  # Inductor's launcher passes Python floats as fp64
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < heads
    d = tl.arange(0, _D)
    q = tl.load(q_ptr + s * q_ss + h[:, None] * q_sh + d[None, :] * q_sd, mask=h_mask[:, None], other=0.0)
    r = _D + tl.arange(0, _ROPE)
    if ROPE_QK:
        q_rope = tl.load(q_ptr + s * q_ss + h[:, None] * q_sh + r[None, :] * q_sd, mask=h_mask[:, None], other=0.0)
    n = width
    if HAS_LEN:
        n = tl.minimum(tl.maximum(tl.load(len_ptr + s * len_s), 0), width)
    acc = tl.zeros((BLOCK_H, _D), dtype=tl.float32)
    m = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j0 in range(0, n, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        t = tl.load(idx_ptr + s * idx_ss + j * idx_sj, mask=j < n, other=-1)
        valid = (t >= 0) & (t < s_kv)
        t = tl.where(valid, t, 0).to(tl.int64)
        k = tl.load(kv_ptr + t[:, None] * kv_s + d[None, :] * kv_sd, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k))
        if ROPE_QK:
            k_rope = tl.load(kv_ptr + t[:, None] * kv_s + r[None, :] * kv_sd, mask=valid[:, None], other=0.0)
            scores = tl.dot(q_rope, tl.trans(k_rope), scores)
        p, alpha, m, l = _online_softmax(scores, valid, m, l, scale_log2)
        acc = tl.dot(p, k, acc * alpha[:, None])
    lse2, inv_l = _lse2_and_inverse(m, l)
    at = s * heads + h
    tl.store(max_logits_ptr + at, m * _LN2, mask=h_mask)
    _store_final(out_ptr, lse_ptr + at, at, d, h, h_mask, acc, lse2, inv_l, sink_ptr, sink_stride, HAS_SINK, h_mask)


_JITTED = (
    "_counted", "_longest_first", "_records", "_e4m3_values", "_ue8m0_scale", "_e4m3_scale", "_e2m1_values",
    "_fp8_piece", "_bf16_piece", "_fp4_piece", "_piece", "_online_softmax", "_attend", "_lse2_and_inverse",
    "_sink_and_lse", "_final_factor", "_store_columns", "_store_pieces", "_store_final", "_decode_kernel", "_combine",
    "_combine_kernel", "_prefill_kernel",
)
def _triton():
    """Import Triton and jit this module's kernels in place, once (:mod:`.common`)."""
    return triton_common.jit_in_place(globals(), _CONSTEXPRS, _JITTED)


# --------------------------------------------------------------------------------------------
# Launchers, shared by the eager kernels and the torch.compile decomposition
# --------------------------------------------------------------------------------------------


def decode_splits(device: torch.device, programs, keys: int, block_n: int):
    """Splits of each row's keys: enough programs to fill the device once, with at least
    :data:`MIN_SPLIT_KEYS` (and one key block) per split, at most :data:`MAX_SPLITS`. A function of
    shapes only; guard-free for symbolic ``programs``."""
    per_split = max(MIN_SPLIT_KEYS, block_n)
    cap = max(1, min(MAX_SPLITS, -(-int(keys) // per_split)))  # index widths are specialised
    return torch.sym_max(1, torch.sym_min(cap, triton_common.compute_units(device) // torch.sym_max(programs, 1)))


def decode_plan(device: torch.device, rows, heads: int, keys: int):
    """``(config, heads per program, splits)`` of a decode launch over ``rows`` query rows of
    ``heads`` heads and ``keys`` index columns (main + extra)."""
    config = decode_config(device)
    block_h = _block_h(config, heads)
    return config, block_h, decode_splits(device, rows * -(-heads // block_h), keys, config.block_n)


def decode_loop_stages(config: Config, splits, width: int, extra_width: int) -> tuple:
    """``(STAGES, X_STAGES)``: the pipeline stages of the decode's main- and extra-cache loops
    (None: the launch's ``num_stages``), for ``splits`` of the virtual key list: ``width`` main
    index columns padded to whole key blocks, then ``extra_width`` extra ones. Where every split
    holds at most one key block there is nothing to overlap, and both loops take one stage (H200,
    measured while the loops still hoisted: 1.2x faster at T = 1 and 8); otherwise the main loop
    takes ``num_stages`` and the extra loop ``config.extra_stages``. A symbolic split count
    (traced) takes the latter: no guard."""
    block = config.block_n
    keys = -(-int(width) // block) * block + int(extra_width)  # index widths are specialised
    if isinstance(splits, int) and keys <= splits * block:
        return 1, 1
    return None, config.extra_stages


def decode_order(config: Config, rows, wave: int, splits, width: int, extra_width: int,
                 has_lengths: bool) -> tuple:
    """``(ORDER, ORDER_ROWS, ORDER_BINS)`` of a decode launch: whether its programs take the rows
    longest first (most key blocks, by the lengths; :func:`_longest_first`). That pays where rows of
    one split each fill more than one ``wave`` of programs: the hardware starts programs in order, so
    the longest rows start first and short ones fill the last wave (H200, T = 256 rows of 5-10 key
    blocks in random order: the same launch took 0.90x the time with the rows sorted longest first).
    Only with lengths (else all rows are alike) and up to :data:`ORDER_MAX_ROWS` rows. ``ORDER`` 1:
    ordered; 0: not; 2: decided in the kernel (a symbolic row or split count: no guard)."""
    static = isinstance(rows, int) and isinstance(splits, int)
    if not has_lengths or static and not (splits == 1 and wave < rows <= ORDER_MAX_ROWS):
        return 0, 1, 1
    blocks = -(-int(width) // config.block_n) + -(-int(extra_width) // config.block_n)  # widths specialised
    bins = 1 << blocks.bit_length()  # a power of two > blocks
    return (1, 1 << (rows - 1).bit_length(), bins) if static else (2, ORDER_MAX_ROWS, bins)


def _partial_mode(splits) -> int:
    """The decode kernel's ``PARTIAL``: 0 for one split, 1 for several, 2 for a symbolic count
    (traced with dynamic shapes), which the kernels then read at run time: no guard, no recompile."""
    if isinstance(splits, int):
        return 1 if splits > 1 else 0
    return 2


#: Per cache format, the decode kernel's constexprs: format id, data bytes, scale bytes, interleaved.
FORMAT_CONSTEXPRS = {
    fmt: (0 if fmt.is_v4 else 1 if fmt.values == "fp8" else 2, fmt.data_bytes, fmt.scale_bytes, fmt.interleaved)
    for fmt in layout.FORMATS.values()
}


def _format_kwargs(kv_format: layout.CacheFormat, extra_kv_format: layout.CacheFormat | None) -> dict:
    main = FORMAT_CONSTEXPRS[kv_format]
    extra = FORMAT_CONSTEXPRS[extra_kv_format or kv_format]
    names = ("FMT", "DATA_BYTES", "SCALE_BYTES", "INTERLEAVED")
    return {**dict(zip(names, main)), **dict(zip(("X_" + n for n in names), extra))}


def _page_shift(page_size) -> tuple[int, bool]:
    """``(log2 page_size, True)`` for a page size that is a power of two, else ``(0, False)``; a
    symbolic page size (traced) takes the division path: no guard on its value."""
    if isinstance(page_size, int) and layout.is_power_of_two(page_size):
        return page_size.bit_length() - 1, True
    return 0, False


def _decode(kernels, q, k_cache, page_size, indices, topk_length, attn_sink,
            extra_k_cache, extra_page_size, extra_indices, extra_topk_length, softmax_scale, head_dim_v,
            kv_format=layout.V4, extra_kv_format=None):
    """Allocate the outputs (and a workspace if split) and launch; ``kernels`` maps a jitted
    kernel to what is launched (itself, or its ``wrap_triton`` wrapper)."""
    batch, s_q, heads = q.shape[:3]
    out, lse = decode_outputs(q, head_dim_v)
    rows = batch * s_q
    if rows == 0:  # nothing to launch
        return out, lse
    has_extra = extra_k_cache is not None
    width, extra_width = indices.shape[-1], extra_indices.shape[-1] if has_extra else 0
    config, block_h, splits = decode_plan(q.device, rows, heads, width + extra_width)
    stages, x_stages = decode_loop_stages(config, splits, width, extra_width)
    head_blocks = -(-heads // block_h)
    wave = triton_common.compute_units(q.device) // max(head_blocks, 1)  # rows of one launch's first wave
    has_len, has_x_len = topk_length is not None, has_extra and extra_topk_length is not None
    order = decode_order(config, rows, wave, splits, width, extra_width, has_len or has_x_len)
    partial = _partial_mode(splits)
    split = partial > 0
    shift, pow2 = _page_shift(page_size)
    if has_extra:
        x_shift, x_pow2 = _page_shift(extra_page_size)
        x = (extra_k_cache, extra_page_size, x_shift, extra_k_cache.stride(0), extra_indices,
             *extra_indices.stride(), extra_indices.shape[-1])
    else:  # never read: the main cache's arguments stand in
        x_pow2 = pow2
        x = (k_cache, page_size, shift, k_cache.stride(0), indices, *indices.stride(), 0)
    x_len = extra_topk_length if has_extra and extra_topk_length is not None else indices
    length = topk_length if topk_length is not None else indices
    sink = attn_sink if attn_sink is not None else q
    if split:
        part = q.new_empty(rows, splits, heads, layout.HEAD_DIM, dtype=torch.float32)
        part_lse = q.new_empty(rows, splits, heads, dtype=torch.float32)
    else:  # never written (PARTIAL=0): q stands in
        part = part_lse = q
    kernels(_decode_kernel)[(rows, head_blocks, splits)](
        q, *q.stride(),
        k_cache, page_size, shift, k_cache.stride(0), indices, *indices.stride(), indices.shape[-1],
        length, length.stride(0),
        *x, x_len, x_len.stride(0),
        sink, sink.stride(0), out, lse, lse.stride(0), lse.stride(2), lse.stride(1), part, part_lse,
        rows, s_q, heads, splits, wave, softmax_scale * LOG2E,
        HAS_LEN=has_len, HAS_EXTRA=has_extra, HAS_X_LEN=has_x_len, HAS_SINK=attn_sink is not None,
        PARTIAL=partial, BLOCK_H=block_h, BLOCK_N=config.block_n, **_format_kwargs(kv_format, extra_kv_format),
        POW2=pow2, X_POW2=x_pow2, HW=triton_common.hardware_conversions(q.device, _decode_kernel),
        STAGES=stages, X_STAGES=x_stages, ORDER=order[0], ORDER_ROWS=order[1], ORDER_BINS=order[2],
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split:
        kernels(_combine_kernel)[(rows, -(-heads // COMBINE_BLOCK_H), layout.HEAD_DIM // COMBINE_BLOCK_D)](
            part, part_lse, sink, sink.stride(0), out, lse, lse.stride(0), lse.stride(2), lse.stride(1),
            s_q, heads, splits, HAS_SINK=attn_sink is not None, BLOCK_H=COMBINE_BLOCK_H, BLOCK_D=COMBINE_BLOCK_D,
            num_warps=4,
        )
    return out, lse


def _prefill(kernels, q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    s_q, heads = q.shape[:2]
    out, max_logits, lse = prefill_outputs(q, d_v)
    if s_q == 0:  # nothing to launch
        return out, max_logits, lse
    config = prefill_config(q.device)
    block_h = _block_h(config, heads)
    length = topk_length if topk_length is not None else indices
    sink = attn_sink if attn_sink is not None else q
    kernels(_prefill_kernel)[(s_q, -(-heads // block_h))](
        q, *q.stride(), kv, kv.stride(0), kv.stride(2), kv.shape[0],
        indices, indices.stride(0), indices.stride(2), indices.shape[-1], length, length.stride(0),
        sink, sink.stride(0), out, max_logits, lse, heads, sm_scale * LOG2E,
        HAS_LEN=topk_length is not None, HAS_SINK=attn_sink is not None,
        BLOCK_H=block_h, BLOCK_N=config.block_n, ROPE_QK=q.shape[-1] != layout.HEAD_DIM,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, max_logits, lse


_eager = triton_common.eager  # eager launches: jitted kernel -> its EagerLauncher


# --------------------------------------------------------------------------------------------
# The provider kernels (eager) and the loader
# --------------------------------------------------------------------------------------------


def flash_mla_with_kvcache(
    q, k_cache, page_size, indices, topk_length, attn_sink,
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format=layout.V4, extra_kv_format=None,
):
    """``dsv4::flash_mla_with_kvcache`` (docs/design.md §2.3) on validated arguments, every cache
    format; scheduler metadata is ignored. No host sync: capture-safe."""
    _triton()
    with triton_common.device_guard(q.device):
        return _decode(_eager, q, k_cache, page_size, indices, topk_length, attn_sink,
                       extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
                       softmax_scale, head_dim_v, kv_format, extra_kv_format)


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    """``dsv4::flash_mla_sparse_fwd`` (docs/design.md §2.4) on validated arguments: ``(out, max_logits,
    lse)``, natural log. No host sync: capture-safe."""
    _triton()
    with triton_common.device_guard(q.device):
        return _prefill(_eager, q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


KERNELS = {DECODE: flash_mla_with_kvcache, PREFILL: flash_mla_sparse_fwd}
NAME = "triton"


def load(device: torch.device) -> dict:
    """Provider loader: ``{op: kernel}`` for decode, prefill and the (schedule-free) metadata, or
    :class:`~dsv4_compile.dispatch.ProviderUnavailable` saying why not (no Triton, no Triton
    backend for the device type, no such device, an NVIDIA GPU before SM80)."""
    triton_common.require_device(_triton(), _decode_kernel, device, "attention")
    capability = _geometry_capability(device)
    if capability is not None and capability < MIN_CAPABILITY:
        raise dispatch.ProviderUnavailable(
            f"the Triton attention kernels need an NVIDIA GPU of compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later, got {capability[0]}.{capability[1]}"
        )
    # the decode ignores metadata: the reference's zeros
    return {**KERNELS, **{op: reference.KERNELS[op] for op in dispatch.METADATA_OPS}}


def register() -> None:
    """Register the attention's ``triton`` entries for ``"cuda"`` and ``"xpu"`` (idempotent)."""
    for device_type in triton_common.DEVICE_TYPES:
        dispatch.register_provider(dispatch.Provider(NAME, device_type, load, ops=(*OPS, *dispatch.METADATA_OPS), fallback=True))


register()


# --------------------------------------------------------------------------------------------
# Inductor visibility: decompose the ops into their Triton launches under functionalization.
# --------------------------------------------------------------------------------------------


def inlines(op: str, device: torch.device, args: tuple | None = None) -> bool:
    """Whether ``torch.compile`` traces attention op ``op`` on ``device`` (for a call with ``args``)
    into this module's launches (:func:`.common.inlines`)."""
    return triton_common.inlines(op, device, args, KERNELS[op], _decode_kernel)


def _decode_traced(kernels, *args):
    return _decode(kernels, *args[:10], *args[12:])  # the scheduler metadata is not used


_lib = torch.library.Library("dsv4", "FRAGMENT")
for _op, _launch in ((DECODE, _decode_traced), (PREFILL, _prefill)):
    triton_common.decompose(_lib, _op, _launch, inlines)
for _op, _names in ((DECODE, ("_decode_kernel", "_combine_kernel")), (PREFILL, ("_prefill_kernel",))):
    triton_common.register_cache_key(
        _op, triton_common.InlinedKernels(functools.partial(inlines, _op), _names, globals())
    )
