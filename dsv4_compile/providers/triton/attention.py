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

The kernels are plain ``@triton.jit`` functions in :mod:`.kernels.attention`, imported with Triton
on first use, as in :mod:`.store`. Under ``torch.compile`` the ops are decomposed into their
Triton launches (:func:`.common.decompose`, as for the store) when this module's kernel serves the op on the device at compile time
(:func:`inlines`), so Inductor sees the launches and allocates their outputs itself.
"""

from __future__ import annotations

import functools
import math
import os
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
#: Sets :data:`INVARIANT_SPLIT_KEYS` for the process (:func:`invariant_split_keys_from_environment`).
INVARIANT_SPLIT_KEYS_ENV = "DSV4_COMPILE_INVARIANT_SPLIT_KEYS"
DEFAULT_INVARIANT_SPLIT_KEYS = 256


def invariant_split_keys_from_environment() -> int:
    """``DSV4_COMPILE_INVARIANT_SPLIT_KEYS``, a positive multiple of every decode geometry's key
    block (so that no geometry rounds it), or :data:`DEFAULT_INVARIANT_SPLIT_KEYS` if unset or
    empty."""
    text = os.environ.get(INVARIANT_SPLIT_KEYS_ENV, "").strip()
    if not text:
        return DEFAULT_INVARIANT_SPLIT_KEYS
    multiple = math.lcm(DECODE_CONFIG.block_n, DECODE_CONFIG_SMALL.block_n)
    value = int(text) if text.lstrip("-").isdigit() else 0
    if value <= 0 or value % multiple:
        raise ValueError(f"{INVARIANT_SPLIT_KEYS_ENV} must be a positive multiple of {multiple} "
                         f"(keys per split of a row in the batch-invariant mode), got {text!r}")
    return value


#: Keys per split of a row in the batch-invariant mode (:func:`invariant_splits`): a row's
#: reduction is cut where its own list is, whatever the batch; larger splits move less partial data
#: (a split's ``[H, 512]`` fp32 result, the bytes of ~220 keys at 64 heads), smaller ones leave
#: more programs to a small batch (``benchmarks/RESULTS.md``, "Batch-invariant mode", has the time
#: at each size). Read once, when the package is imported (this module registers the provider then):
#: a later change would leave compiled programs with the old size.
INVARIANT_SPLIT_KEYS = invariant_split_keys_from_environment()
#: Eager decode launches are programmatic dependent launches (``griddepcontrol``) from this NVIDIA
#: compute capability on: the combine kernel is scheduled while the decode kernel runs, and the
#: decode kernel while its predecessor does, each waiting for it before touching memory.
PDL_CAPABILITY = (9, 0)
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
# The kernels: plain @triton.jit functions in .kernels.attention, imported with Triton on first use.
# --------------------------------------------------------------------------------------------

KERNELS_MODULE = f"{__package__}.kernels.attention"


def _kernels():
    """This provider's jitted kernels, :mod:`.kernels.attention` (imported with Triton on first use)."""
    return triton_common.kernels(KERNELS_MODULE)


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


def invariant_splits(config: Config, width: int, extra_width: int) -> tuple[int, int]:
    """``(splits, split_keys)`` of a decode launch in the batch-invariant mode: each row's virtual
    list (its main entries padded to whole key blocks, then its extra ones) is cut into splits of
    ``split_keys`` entries (:data:`INVARIANT_SPLIT_KEYS`, more where the index widths would need
    more than :data:`MAX_SPLITS`): a function of the widths alone, never of the batch; the launch
    has the splits of the widest possible row, and a row's programs past its own return at once."""
    block = config.block_n
    blocks = -(-int(width) // block) + -(-int(extra_width) // block)  # index widths are specialised
    per_split = max(INVARIANT_SPLIT_KEYS // block, -(-blocks // MAX_SPLITS))
    return max(1, -(-blocks // per_split)), per_split * block


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
            kv_format=layout.V4, extra_kv_format=None, batch_invariant=False):
    """Allocate the outputs (and a workspace if split) and launch; ``kernels`` maps a jitted
    kernel to what is launched (itself, or its ``wrap_triton`` wrapper). ``batch_invariant``: the
    splits of :func:`invariant_splits` instead of :func:`decode_plan`'s."""
    batch, s_q, heads = q.shape[:3]
    out, lse = decode_outputs(q, head_dim_v)
    rows = batch * s_q
    if rows == 0:  # nothing to launch
        return out, lse
    has_extra = extra_k_cache is not None
    width, extra_width = indices.shape[-1], extra_indices.shape[-1] if has_extra else 0
    config, block_h, splits = decode_plan(q.device, rows, heads, width + extra_width)
    split_keys = 0  # unused outside the batch-invariant mode
    if batch_invariant:
        splits, split_keys = invariant_splits(config, width, extra_width)
    stages, x_stages = decode_loop_stages(config, splits, width, extra_width)
    head_blocks = -(-heads // block_h)
    wave = triton_common.compute_units(q.device) // max(head_blocks, 1)  # rows of one launch's first wave
    has_len, has_x_len = topk_length is not None, has_extra and extra_topk_length is not None
    order = decode_order(config, rows, wave, splits, width, extra_width, has_len or has_x_len)
    partial = _partial_mode(splits)
    split = partial > 0
    shift, pow2 = _page_shift(page_size)
    # eager launches only (PDL_CAPABILITY): Inductor takes no launch attribute for a traced kernel
    pdl = kernels is _eager and _kernels().PDL_AVAILABLE and triton_common.nvidia_compiled(
        q.device, _kernels().decode_kernel, PDL_CAPABILITY)
    launch = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
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
    kernels(_kernels().decode_kernel)[(rows, head_blocks, splits)](
        q, *q.stride(),
        k_cache, page_size, shift, k_cache.stride(0), indices, *indices.stride(), indices.shape[-1],
        length, length.stride(0),
        *x, x_len, x_len.stride(0),
        sink, sink.stride(0), out, lse, lse.stride(0), lse.stride(2), lse.stride(1), part, part_lse,
        rows, s_q, heads, splits, split_keys, wave, softmax_scale * LOG2E,
        HAS_LEN=has_len, HAS_EXTRA=has_extra, HAS_X_LEN=has_x_len, HAS_SINK=attn_sink is not None,
        PARTIAL=partial, INVARIANT=batch_invariant, BLOCK_H=block_h, BLOCK_N=config.block_n, **_format_kwargs(kv_format, extra_kv_format),
        POW2=pow2, X_POW2=x_pow2, HW=triton_common.hardware_conversions(q.device, _kernels().decode_kernel),
        STAGES=stages, X_STAGES=x_stages, ORDER=order[0], ORDER_ROWS=order[1], ORDER_BINS=order[2],
        num_warps=config.num_warps, num_stages=config.num_stages, **launch,
    )
    if split:
        kernels(_kernels().combine_kernel)[(rows, -(-heads // COMBINE_BLOCK_H), layout.HEAD_DIM // COMBINE_BLOCK_D)](
            part, part_lse, sink, sink.stride(0), out, lse, lse.stride(0), lse.stride(2), lse.stride(1),
            s_q, heads, splits, length, length.stride(0), x_len, x_len.stride(0), indices.shape[-1], x[-1],
            split_keys, HAS_SINK=attn_sink is not None, BLOCK_H=COMBINE_BLOCK_H, BLOCK_D=COMBINE_BLOCK_D,
            INVARIANT=batch_invariant, HAS_LEN=has_len, HAS_EXTRA=has_extra, HAS_X_LEN=has_x_len,
            BLOCK_N=config.block_n, num_warps=4, **launch,
        )
    return out, lse


def _prefill(kernels, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, batch_invariant=False):
    """Allocate the outputs and launch. One program per (query, head block) over all of the query's
    keys, whatever the batch: batch-invariant in either mode."""
    s_q, heads = q.shape[:2]
    out, max_logits, lse = prefill_outputs(q, d_v)
    if s_q == 0:  # nothing to launch
        return out, max_logits, lse
    config = prefill_config(q.device)
    block_h = _block_h(config, heads)
    length = topk_length if topk_length is not None else indices
    sink = attn_sink if attn_sink is not None else q
    kernels(_kernels().prefill_kernel)[(s_q, -(-heads // block_h))](
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
    batch_invariant=False,
):
    """``dsv4::flash_mla_with_kvcache`` (docs/design.md §2.3) on validated arguments, every cache
    format; scheduler metadata is ignored. No host sync: capture-safe."""
    with triton_common.device_guard(q.device):
        return _decode(_eager, q, k_cache, page_size, indices, topk_length, attn_sink,
                       extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
                       softmax_scale, head_dim_v, kv_format, extra_kv_format, batch_invariant)


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, batch_invariant=False):
    """``dsv4::flash_mla_sparse_fwd`` (docs/design.md §2.4) on validated arguments: ``(out, max_logits,
    lse)``, natural log. No host sync: capture-safe."""
    with triton_common.device_guard(q.device):
        return _prefill(_eager, q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


KERNELS = {DECODE: flash_mla_with_kvcache, PREFILL: flash_mla_sparse_fwd}
NAME = "triton"


def load(device: torch.device) -> dict:
    """Provider loader: ``{op: kernel}`` for decode, prefill and the (schedule-free) metadata, or
    :class:`~dsv4_compile.dispatch.ProviderUnavailable` saying why not (no Triton, no Triton
    backend for the device type, no such device, an NVIDIA GPU before SM80)."""
    triton_common.require_device(_kernels().decode_kernel, device, "attention")
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
        dispatch.register_provider(dispatch.Provider(
            NAME, device_type, load, ops=(*OPS, *dispatch.METADATA_OPS), fallback=True, invariant=dict.fromkeys(OPS),
        ))


register()


# --------------------------------------------------------------------------------------------
# Inductor visibility: decompose the ops into their Triton launches under functionalization.
# --------------------------------------------------------------------------------------------


def inlines(op: str, device: torch.device, args: tuple | None = None) -> bool:
    """Whether ``torch.compile`` traces attention op ``op`` on ``device`` (for a call with ``args``)
    into this module's launches (:func:`.common.inlines`)."""
    return triton_common.inlines(op, device, args, KERNELS[op], lambda: _kernels().decode_kernel)


def _decode_traced(kernels, *args):
    return _decode(kernels, *args[:10], *args[12:])  # the scheduler metadata is not used


_lib = torch.library.Library("dsv4", "FRAGMENT")
for _op, _launch in ((DECODE, _decode_traced), (PREFILL, _prefill)):
    triton_common.decompose(_lib, _op, _launch, inlines)
for _op, _names in ((DECODE, ("decode_kernel", "combine_kernel")), (PREFILL, ("prefill_kernel",))):
    triton_common.register_cache_key(
        _op, triton_common.InlinedKernels(functools.partial(inlines, _op), _names, KERNELS_MODULE)
    )
