"""Triton kernels for ``dsv4::indexer_logits``, ``dsv4::indexer_topk``, ``dsv4::indexer_store``,
``dsv4::indexer_cache_logits`` and ``dsv4::indexer_cache_topk`` on CUDA and XPU (provider
``"triton"``; the paged cache's: docs/design.md §2.11, §2.12, :func:`indexer_store`,
:func:`indexer_cache_logits`, :func:`table_logits` and its tile kernel).

A program scores ``BLOCK_N`` blocks of one query row at a time (docs/design.md §2.8)::

    logits[t, k] = sum_h w[t, h] * relu(<q[t, h], keys[block_slots[t, k]]>)     fp32
    logits[t, k] = -inf                                   where block_slots[t, k] == -1

The ``BLOCK_N`` keys are gathered by slot once and scored against every head, ``BLOCK_H`` heads
at a time, by one ``tl.dot`` of float32 operands (:func:`precision`: 3xTF32 on the tensor cores of
NVIDIA GPUs, ~float32; float32 FMAs elsewhere). ``BLOCK_N`` columns all ``-1`` (past the query's
visible blocks) read no key and score no head, so a query's cost follows its visible blocks, not
the width of ``block_slots`` (the capacity of a request's cache); nothing is gathered into memory.
A row's column blocks (``BLOCK_N`` columns each) are shared among :func:`programs_per_row`
programs, enough to fill the device once, so the column blocks past the visible ones cost a few
stores in a program that scores, not programs of their own. On the H200 (benchmarks/RESULTS.md,
"Indexer logits") IEEE float32 ``tl.dot`` ran 2.1-2.5x slower than 3xTF32 at the model's shapes
(same geometry).

The top-k (docs/design.md §2.9): one program per row holds the row's values in registers as
32-bit keys whose unsigned order is the op's value order (:func:`~.reference.topk_keys`' high
word), finds the ``k``-th largest a bit at a time from the top (counts of the keys that reach a
probe: ~3 instructions per key and bit, where a 256-bin ``tl.histogram`` costs ~7 per key and bit
in warp votes and masks; at most 32 counts, fewer where exactly ``k`` keys reach a probe, and
none where the row has fewer than ``k`` keys above its smallest), then writes every column above
it and the first columns equal to it, in column order (one prefix sum of both counts): one launch
and no sort, where ``torch.topk`` takes several. Rows wider than :data:`TOPK_CHUNK` (a
``max_seq_len`` past 16384; :func:`topk_program`): by pieces, each piece's top ``k`` selected in
parallel by the same program, then the top ``k`` of those candidates (:func:`_launch_split`).
Rows wider than :data:`TOPK_MAX_WIDTH` with ``k`` past a quarter of a piece: a program per row
that reads it in chunks, four 256-bin histogram passes (a radix select a byte at a time: fewer
reads of the row than a bit at a time), then one pass that writes.

The kernels are plain ``@triton.jit`` functions in :mod:`.kernels.indexer`, imported with Triton
on first use. Under ``torch.compile`` the op
stays an opaque call (it has no Inductor decomposition): dynamic token counts and CUDA graphs
take it as any other op.
"""

from __future__ import annotations

import torch

from ... import dispatch, layout
from ...ops.indexer import indexer_logits_output, indexer_topk_output
from .. import reference
from . import common as triton_common

OP, TOPK, STORE, CACHE = "indexer_logits", "indexer_topk", "indexer_store", "indexer_cache_logits"
CACHE_TOPK = "indexer_cache_topk"
#: Bytes of one group's visible slots and logits in ``dsv4::indexer_cache_topk`` that
#: :func:`cache_topk_rows` aims at: a prefill chunk's selection holds about this much at a time,
#: whatever the context.
CACHE_TOPK_GROUP_BYTES = 512 << 20
NAME = "triton"
#: Launch geometry (a rule, from a sweep on the H200: benchmarks/history/RESULTS-notebook.md):
#: 64 blocks per program and 32 heads per ``tl.dot`` up to 128-dim keys, 16 and 16 beyond (the
#: ``[BLOCK, D]`` query and key tiles then stay within registers); 4 warps.
BLOCK_N, BLOCK_H, BLOCK_WIDE, NUM_WARPS = 64, 32, 16, 4
#: Programs of the logits kernel per SM / Xe-core that the grid aims at (:func:`programs_per_row`):
#: two fit on an H200 SM (252 registers per thread and 98 KB of shared memory per 4-warp program).
PROGRAMS_PER_UNIT = 2
#: The top-k's programs (:func:`topk_program`): rows of up to :data:`TOPK_CHUNK` columns in
#: registers; wider ones by :data:`TOPK_CHUNK`-column pieces selected in parallel
#: (:func:`_launch_split`) while ``4 k <= TOPK_CHUNK``; past that, in registers up to
#: :data:`TOPK_MAX_WIDTH` columns (the widest the in-register program is built for), beyond by a
#: program per row that reads it :data:`TOPK_CHUNK` columns at a time with :data:`TOPK_CHUNK_WARPS`
#: warps (the fastest of the sweep on the H200 at 4096 to 32768 columns:
#: benchmarks/history/RESULTS-notebook.md).
TOPK_MAX_WIDTH, TOPK_CHUNK, TOPK_CHUNK_WARPS = 8192, 4096, 8


def topk_warps(block: int) -> int:
    """Warps of the in-register top-k program over rows of ``block`` (a power of two) columns, a
    rule from the sweep on the H200 (benchmarks/RESULTS.md, "Indexer top-k"): 4 up to 2048
    columns, 8 beyond; the fastest, or within 2% of it, at 1, 64 and 8192 rows of every width
    measured (1024 to 8192)."""
    return 4 if block <= 2048 else 8


# --------------------------------------------------------------------------------------------
# The kernels: plain @triton.jit functions in .kernels.indexer, imported with Triton on first use.
# --------------------------------------------------------------------------------------------

KERNELS_MODULE = f"{__package__}.kernels.indexer"


def _kernels():
    """This provider's jitted kernels, :mod:`.kernels.indexer` (imported with Triton on first use)."""
    return triton_common.kernels(KERNELS_MODULE)


def geometry(dim: int, heads: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_H, BLOCK_D)`` for keys of ``dim`` and ``heads`` query heads: the key
    padded to a power of two (``tl.dot`` needs >= 16), :data:`BLOCK_N` / :data:`BLOCK_H` up to
    128-dim keys and :data:`BLOCK_WIDE` beyond; no more heads per dot than there are (>= 16)."""
    block_d = max(16, triton_common.next_power_of_2(dim))
    block = BLOCK_N if block_d <= 128 else BLOCK_WIDE
    block_h = min(BLOCK_H if block_d <= 128 else BLOCK_WIDE, max(16, triton_common.next_power_of_2(heads)))
    return block, block_h, block_d


def indexer_logits(q, weights, keys, block_slots, batch_invariant=False):
    """``dsv4::indexer_logits`` (eager) on validated arguments: one launch, no host sync. A logit
    is one program's computation over its query and key alone, whichever program and however many
    rows: batch-invariant in either mode."""
    logits = indexer_logits_output(q, block_slots)
    with triton_common.device_guard(q.device):
        launch(q, weights, keys, block_slots, logits)
    return logits


def programs_per_row(device: torch.device, tokens: int, blocks: int) -> int:
    """Programs that share a row's ``blocks`` column blocks (program ``j`` takes blocks ``j``,
    ``j + n``, ...): as many as fill the device once, :data:`PROGRAMS_PER_UNIT` per SM / Xe-core,
    over the ``tokens`` rows, at least 1 and at most ``blocks``. Every column's logit is the same
    computation whichever program takes it, so this changes speed only. A grid of a program per
    block (the rule before) ran blocks past a row's visible ones as programs of their own, which
    hold the same registers and shared memory as scoring ones: at 64 decode rows of 1024 columns
    with 256 visible, 1024 programs in 3.9 waves for 256 that score (benchmarks/RESULTS.md,
    "Indexer logits")."""
    return max(1, min(blocks, PROGRAMS_PER_UNIT * triton_common.compute_units(device) // max(tokens, 1)))


def launch(q, weights, keys, block_slots, logits, blocks=None, num_warps=NUM_WARPS, programs=None) -> None:
    """Write ``logits`` with one launch (none for an empty call); ``blocks``: ``(BLOCK_N,
    BLOCK_H)`` instead of :func:`geometry`'s, ``programs``: programs per row instead of
    :func:`programs_per_row`'s (both for sweeps)."""
    tokens, heads, dim = q.shape
    width = block_slots.shape[1]
    if tokens == 0 or width == 0:
        return
    block_n, block_h, block_d = geometry(dim, heads)
    if blocks is not None:
        block_n, block_h = blocks
    column_blocks = -(-width // block_n)
    programs = min(programs or programs_per_row(q.device, tokens, column_blocks), column_blocks)
    qs, ws, ks, ss = q.stride(), weights.stride(), keys.stride(), block_slots.stride()
    triton_common.eager(_kernels().logits_kernel)[(tokens, programs)](
        q, weights, keys, block_slots, logits,
        heads, dim, width,
        qs[0], qs[1], qs[2], ws[0], ws[1], ks[0], ks[1], ss[0], ss[1], logits.stride()[0],
        BLOCK_N=block_n, BLOCK_H=block_h, BLOCK_D=block_d, PRECISION=precision(q.device), num_warps=num_warps,
    )


def indexer_topk(logits, k):
    """``dsv4::indexer_topk`` (eager) on validated arguments: one launch (none for an empty call),
    no host sync."""
    out = indexer_topk_output(logits, k)
    with triton_common.device_guard(logits.device):
        launch_topk(logits, k, out)
    return out


def topk_program(width: int, k: int) -> str:
    """Which top-k program serves rows of ``width`` columns (a rule from the sweep on the H200,
    benchmarks/RESULTS.md, "Indexer top-k"): ``"registers"`` up to :data:`TOPK_CHUNK` columns;
    past it ``"split"`` when the pieces shrink the row at least 4-fold (``4 k <= TOPK_CHUNK``),
    else ``"registers"`` up to :data:`TOPK_MAX_WIDTH` columns and ``"looped"`` beyond. At k = 512
    by pieces was faster than the looped program at every row count measured (1 to 8192 rows of
    16384 to 131072 columns; 1.7-2x from 128 rows) and, at 8192 columns, 10-18% faster than the
    in-register program from 1024 rows, within 10% of it at 1 and 64 rows."""
    if width <= TOPK_CHUNK:
        return "registers"
    if 4 * k <= TOPK_CHUNK:
        return "split"
    return "registers" if width <= TOPK_MAX_WIDTH else "looped"


def launch_topk(logits, k, out, num_warps=None, chunk=None, program=None) -> None:
    """Write ``out`` (none launched for an empty call) with the program :func:`topk_program`
    picks, or ``program``: ``"registers"`` (one launch), ``"looped"`` (one launch, ``chunk``
    columns at a time) or ``"split"`` (a launch per step, :func:`_launch_split`).
    ``chunk`` (default :data:`TOPK_CHUNK`) and ``num_warps`` (default: the rule's) are for tests
    and sweeps."""
    tokens, width = logits.shape
    if tokens == 0 or k == 0:
        return
    program = program or topk_program(width, k)
    chunk = chunk or TOPK_CHUNK
    if program == "split":
        _launch_split(logits, k, out, chunk, num_warps)
        return
    x_t, x_m = logits.stride()
    if program == "registers":
        _launch_in_registers(logits, logits, out, width, k, x_t, x_m, False, num_warps)
    elif program == "looped":
        triton_common.eager(_kernels().topk_looped_kernel)[(tokens,)](
            logits, out, width, k, x_t, x_m, out.stride()[0], CHUNK=chunk, num_warps=num_warps or TOPK_CHUNK_WARPS,
        )
    else:
        raise ValueError(f"program must be 'registers', 'looped' or 'split', got {program!r}")


def _launch_in_registers(x, col, out, width, k, x_t, x_m, keys_in, num_warps) -> None:
    """The in-register program over rows of ``width`` columns: float32 logits, or with ``keys_in``
    a candidate list (keys ``x``, columns ``col``), one program per row writing ``out``."""
    # never narrower than 256 columns (the geometry narrow rows are tested in)
    block = max(256, triton_common.next_power_of_2(width))
    triton_common.eager(_kernels().topk_kernel)[(x.shape[0],)](
        x, col, out, out, width, k, x_t, x_m, out.stride()[0],
        BLOCK=block, KEYS_IN=keys_in, KEYS_OUT=False, num_warps=num_warps or topk_warps(block),
    )


def _launch_split(logits, k, out, chunk, num_warps) -> None:
    """The top-k of rows of any width by pieces (``4 k <= chunk``): while a row is wider than
    ``chunk``, one launch selects the top ``k`` of every ``chunk``-column piece of it in parallel
    (a program per piece), whose concatenation, in column order, is the next row: it holds the
    row's top ``k`` (an entry among a row's ``k`` largest is among its piece's), in ~``width *
    k / chunk`` columns. Then one program per row selects from what is left. Exact as the other
    programs: equal keys keep their column order through every step. Launches: 1 + log(width /
    chunk) / log(chunk / k) rounded up (at ``k`` = 512: two up to 32768 columns, three up to
    262144)."""
    if 4 * k > chunk:
        raise ValueError(f"the top-k by pieces needs 4 k <= chunk, got k = {k}, chunk = {chunk}")
    rows, width = logits.shape
    x = col = logits
    x_t, x_m, keys_in = logits.stride()[0], logits.stride()[1], False
    while width > chunk:
        pieces = -(-width // chunk)
        narrow = (pieces - 1) * k + min(k, width - (pieces - 1) * chunk)
        keys = torch.empty(rows, narrow, dtype=torch.int32, device=logits.device)
        cols = torch.empty(rows, narrow, dtype=torch.int32, device=logits.device)
        triton_common.eager(_kernels().topk_kernel)[(rows, pieces)](
            x, col, cols, keys, width, k, x_t, x_m, narrow,
            BLOCK=chunk, KEYS_IN=keys_in, KEYS_OUT=True, num_warps=num_warps or topk_warps(chunk),
        )
        x, col, width, x_t, x_m, keys_in = keys, cols, narrow, narrow, 1, True
    _launch_in_registers(x, col, out, width, k, x_t, x_m, keys_in, num_warps)


# --------------------------------------------------------------------------------------------
# The paged indexer key cache
# --------------------------------------------------------------------------------------------

#: The kernels' ``FORMAT`` constexpr per index format (``kernels.indexer.FP32`` / ``FP8`` / ``FP4``).
FORMAT_IDS = {"fp32": 0, "fp8": 1, "fp4": 2}
#: Keys per program of the store (one 128-value row a key); 4 warps.
STORE_BLOCK_T, STORE_WARPS = 16, 4


def indexer_store(keys, index_cache, slots, page_size, index_format=layout.INDEX_FP8):
    """``dsv4::indexer_store`` (eager) on validated arguments: one launch (none for no keys)."""
    count = keys.shape[0]
    if count == 0:
        return
    kernel = _kernels().index_store_kernel
    with triton_common.device_guard(keys.device):
        triton_common.eager(kernel)[(-(-count // STORE_BLOCK_T),)](
            keys, index_cache, slots, count, page_size, index_cache.stride(0), keys.stride(0),
            FORMAT=FORMAT_IDS[index_format.values], BLOCK_T=STORE_BLOCK_T,
            HW=triton_common.hardware_conversions(keys.device, kernel), num_warps=STORE_WARPS,
        )


def indexer_cache_logits(q, weights, index_cache, block_slots, page_size, index_format=layout.INDEX_FP8,
                         q_scales=None, batch_invariant=False):
    """``dsv4::indexer_cache_logits`` (eager) on validated arguments: one launch, no host sync;
    batch-invariant in either mode, as :func:`indexer_logits`."""
    logits = indexer_logits_output(q, block_slots)
    if q.shape[0] and block_slots.shape[1]:
        _launch_rows(q, weights, index_cache, page_size, index_format, q_scales, logits, slots=block_slots)
    return logits


def _launch_rows(q, weights, index_cache, page_size, fmt, q_scales, logits, slots=None, table=None):
    """``cache_logits_kernel``: a row's logits by its programs alone, each ``BLOCK_N`` keys gathered
    by ``slots`` (``[T, width]``) or through ``table`` (``(block_table, table_rows, lengths)``)."""
    tokens, heads = q.shape[:2]
    width = logits.shape[1]
    kernel = _kernels().cache_logits_kernel
    block_n, block_h, _ = geometry(layout.INDEX_HEAD_DIM, heads)  # the float32 kernel's, at 128 dims
    programs = programs_per_row(q.device, tokens, -(-width // block_n))
    codes = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q
    scales = codes if q_scales is None else q_scales  # not read without fp4
    block_table, table_rows, lengths = table if table is not None else (slots, slots, slots)  # unread without TABLE
    slots = block_table if slots is None else slots
    qs, ss, ws, bs, ts = codes.stride(), scales.stride(), weights.stride(), slots.stride(), block_table.stride()
    with triton_common.device_guard(q.device):
        triton_common.eager(kernel)[(tokens, programs)](
            codes, scales, weights, index_cache, slots, block_table, table_rows, lengths, logits,
            tokens, heads, width, page_size, index_cache.stride(0),
            qs[0], qs[1], ss[0], ss[1], ws[0], ws[1], bs[0], bs[1], ts[0], ts[1], logits.stride()[0],
            FORMAT=FORMAT_IDS[fmt.values], BLOCK_N=block_n, BLOCK_H=block_h,
            PRECISION=precision(q.device), HW=triton_common.hardware_conversions(q.device, kernel),
            TABLE=table is not None, num_warps=NUM_WARPS,
        )


#: The tile kernel's geometry (``tile_logits_kernel``): queries of one request per program whose
#: heads fill :data:`TILE_COLUMNS` columns of its product (4 queries of DSV4's 64 heads), keys
#: :data:`TILE_BLOCK_N` at a time; warps and pipeline stages (the fastest of a sweep on an H100 at
#: 8192 rows of a 128K-token context: benchmarks/RESULTS.md, "Long context"). Calls of at most
#: :data:`TILE_SINGLE_ROWS` rows (decode) take one query a tile: their rows are mostly of several
#: requests, and a query's keys are read by it alone anyway.
TILE_COLUMNS, TILE_BLOCK_N, TILE_WARPS, TILE_STAGES, TILE_SINGLE_ROWS = 256, 128, 4, 3, 64
#: Programs a SM / Xe-core that single-query tiles aim at (their product holds a quarter of the
#: registers of a 4-query tile's, so more programs fit and hide each other's latency). On an H100
#: at a 1M-token context: 1 decode row 48 / 51 / 50 µs at 2 / 4 / 8 (within the run's noise), 8
#: rows 155 / 162 / 139 µs (benchmarks/history/RESULTS-notebook.md).
TILE_SINGLE_PROGRAMS_PER_UNIT = 8


def tile_geometry(heads: int, tokens: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_N, BLOCK_H)`` of ``tile_logits_kernel`` for ``tokens`` queries of ``heads``
    heads: the heads padded to a power of two (>= 16), as many queries as fill :data:`TILE_COLUMNS`
    (one up to :data:`TILE_SINGLE_ROWS` queries)."""
    block_h = max(16, triton_common.next_power_of_2(heads))
    block_t = 1 if tokens <= TILE_SINGLE_ROWS else max(1, TILE_COLUMNS // block_h)
    return block_t, TILE_BLOCK_N, block_h


def fp8_mma(device: torch.device) -> bool:
    """Whether ``tile_logits_kernel`` multiplies fp8 keys and queries as e4m3 on the tensor cores
    (NVIDIA GPUs of compute capability 8.9 or later, compiled): the products are exact, their sums
    keep fewer bits than float32 (docs/design.md §2.12). Elsewhere as exact bf16 values."""
    return triton_common.nvidia_compiled(device, _kernels().tile_logits_kernel, (8, 9))


def _launch_tiles(q, weights, index_cache, block_table, table_rows, lengths, page_size, fmt, q_scales, logits,
                  geometry, skip_t=0) -> None:
    """``tile_logits_kernel`` over the rows of ``logits`` in tiles of ``geometry = (BLOCK_T,
    BLOCK_N, warps, stages)``, each tile's columns shared among programs as in
    :func:`programs_per_row` (:data:`PROGRAMS_PER_UNIT` per SM, :data:`TILE_SINGLE_PROGRAMS_PER_UNIT`
    for single-query tiles; tiles of several requests, and with ``skip_t`` those inside a
    ``skip_t``-row tile of one request, left to other launches)."""
    tokens, heads = q.shape[:2]
    block_t, block_n, warps, stages = geometry
    block_h = tile_geometry(heads, tokens)[2]
    tiles = -(-tokens // block_t)
    per_unit = TILE_SINGLE_PROGRAMS_PER_UNIT if block_t == 1 else PROGRAMS_PER_UNIT
    programs = max(1, min(-(-logits.shape[1] // block_n), per_unit * triton_common.compute_units(q.device) // tiles))
    kernel = _kernels().tile_logits_kernel
    codes = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q
    scales = codes if q_scales is None else q_scales  # not read without fp4
    qs, ss, ws, ts = codes.stride(), scales.stride(), weights.stride(), block_table.stride()
    with triton_common.device_guard(q.device):
        triton_common.eager(kernel)[(tiles, programs)](
            codes, scales, weights, index_cache, block_table, table_rows, lengths, logits,
            tokens, heads, logits.shape[1], page_size, index_cache.stride(0),
            qs[0], qs[1], ss[0], ss[1], ws[0], ws[1], ts[0], ts[1], logits.stride()[0],
            FORMAT=FORMAT_IDS[fmt.values], BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_H=block_h,
            HW=triton_common.hardware_conversions(q.device, kernel), FP8_MMA=fp8_mma(q.device), SKIP_T=skip_t,
            num_warps=warps, num_stages=stages,
        )


def table_logits(q, weights, index_cache, block_table, table_rows, lengths, page_size, width, fmt,
                 q_scales=None, batch_invariant=False, config=None):
    """``[T, width]`` float32: the block logits of each query's visible blocks through the block
    table (``-inf`` past its length), what :func:`indexer_cache_topk` selects from. ``"fp8"`` /
    ``"fp4"``: ``tile_logits_kernel`` in :func:`tile_geometry`'s tiles of one request, then in
    tiles of one query the rows of the other tiles (two launches; one where the tiles are of one
    query). ``"fp32"``, and every row when ``batch_invariant`` (a row's logits then its programs'
    alone): ``cache_logits_kernel`` through the table. ``config``: ``(BLOCK_T, BLOCK_N, warps,
    stages)`` of the first launch instead of the rule's (sweeps). No host sync."""
    logits = torch.empty(q.shape[0], width, dtype=torch.float32, device=q.device)
    if q.shape[0] == 0 or width == 0:
        return logits
    args = (q, weights, index_cache, block_table, table_rows, lengths, page_size, fmt, q_scales, logits)
    if fmt.values == "fp32" or batch_invariant:
        _launch_rows(q, weights, index_cache, page_size, fmt, q_scales, logits, table=args[3:6])
        return logits
    block_t, block_n, _ = tile_geometry(q.shape[1], q.shape[0])
    config = config or (block_t, block_n, TILE_WARPS, TILE_STAGES)
    _launch_tiles(*args, config)
    if config[0] > 1:
        _launch_tiles(*args, (1, TILE_BLOCK_N, TILE_WARPS, TILE_STAGES), skip_t=config[0])
    return logits


def indexer_cache_topk(q, weights, index_cache, block_table, table_rows, lengths, page_size, k,
                       index_format=layout.INDEX_FP8, q_scales=None, batch_invariant=False):
    """``dsv4::indexer_cache_topk`` (eager) on validated arguments: :func:`indexer_topk` of
    :func:`table_logits` of groups of rows within :data:`CACHE_TOPK_GROUP_BYTES`
    (:func:`~dsv4_compile.providers.reference.cache_topk_in_groups`); no host sync. The selection
    is exact; in ``batch_invariant`` mode a row's logits are computed by its programs alone."""
    width = block_table.shape[1] * page_size

    def group_logits(sl, visible):
        return table_logits(q[sl], weights[sl], index_cache, block_table, table_rows[sl], visible, page_size,
                            width, index_format, None if q_scales is None else q_scales[sl], batch_invariant)

    rows = cache_topk_rows(q.device, width, tile_geometry(q.shape[1], q.shape[0])[0])
    return reference.cache_topk_in_groups(group_logits, indexer_topk, rows, q, lengths, k, width)


def cache_topk_rows(device: torch.device, width: int, block_t: int = 1) -> int:
    """Rows a group of :func:`indexer_cache_topk` (rows of ``width`` float32 logits): as many whole
    waves of the tile kernel's programs (:data:`PROGRAMS_PER_UNIT` per SM / Xe-core, ``block_t``
    rows each) as fit in :data:`CACHE_TOPK_GROUP_BYTES`, one wave at least (a partial wave leaves
    units idle)."""
    wave = PROGRAMS_PER_UNIT * triton_common.compute_units(device) * block_t
    fit = CACHE_TOPK_GROUP_BYTES // (4 * width)
    return max(wave, fit // wave * wave)


def precision(device: torch.device) -> str:
    """The ``tl.dot`` precision of float32 scores on ``device``: ``"tf32x3"`` on NVIDIA GPUs of
    compute capability 8.0 or later, compiled (three TF32 tensor-core products per float32 one:
    each operand split into a TF32 head and a TF32 tail, ~21 of float32's 24 significand bits;
    the tail x tail product dropped), else ``"ieee"`` (float32 FMAs: XPU, ROCm, the interpreter)."""
    return "tf32x3" if triton_common.nvidia_compiled(device, _kernels().logits_kernel, (8, 0)) else "ieee"


def load(device: torch.device) -> dict:
    """Provider loader: the kernel, or :class:`~dsv4_compile.dispatch.ProviderUnavailable` saying why."""
    triton_common.require_device(_kernels().logits_kernel, device, "indexer")
    return {OP: indexer_logits, TOPK: indexer_topk, STORE: indexer_store, CACHE: indexer_cache_logits,
            CACHE_TOPK: indexer_cache_topk}


def register() -> None:
    """Register the indexer's ``triton`` entries for ``"cuda"`` and ``"xpu"`` (idempotent; imports nothing)."""
    for device_type in triton_common.DEVICE_TYPES:
        dispatch.register_provider(dispatch.Provider(
            NAME, device_type, load, ops=(OP, TOPK, STORE, CACHE, CACHE_TOPK), fallback=True,
            invariant=dict.fromkeys((OP, CACHE, CACHE_TOPK)),
        ))


register()
