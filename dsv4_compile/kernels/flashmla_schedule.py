"""FlashMLA's sparse-decode schedule (``get_mla_metadata``'s two tensors) from one Triton program.

FlashMLA's SM90 sparse decode spreads the key blocks of a batch over ``num_sm_parts`` parts (one
per group of SMs); its scheduler, a one-thread CUDA kernel that visits the parts one after the
other, writes what each part computes. The library runs that kernel only inside its decode, so
asking it for a schedule takes a decode over a dummy cache
(:meth:`.flashmla.FlashMLAKernels.library_schedule`, where this program is not used: SM100,
``sgl_kernel``): on the H200 ~35 us per call in a CUDA graph at batch 1, against ~3 us here. This
program computes the same tensors, bit for bit (``tests/test_flashmla_schedule.py`` compares them
with the library's on the GPU), in one launch: the requests one after the other, then every part
at once.

The rule, for FlashMLA's SM90 geometry (:data:`BLOCK` keys per block, :data:`OVERHEAD` blocks of
fixed cost per piece):

* request ``i`` attends ``s_i`` keys: ``topk_length[i]`` (without lengths: the index width padded
  to 64), and 1 if that is 0; with an extra cache, ``s_i`` rounded up to a multiple of 64 plus
  ``extra_topk_length[i]`` (or the padded extra width). It has ``n_i = ceil(s_i / 64)`` blocks;
* a part holds ``payload = ceil(sum_i(n_i + OVERHEAD) / parts) + OVERHEAD`` units, and a piece of
  a request costs ``OVERHEAD`` plus its blocks;
* requests are laid in order: one that fits in what is left of the part goes there whole; else,
  if more than ``OVERHEAD`` units are left, the part is filled with blocks of it and it goes on
  in the next part (which holds ``payload - OVERHEAD`` more of its blocks, and so on); else it
  starts in the next part.

Outputs: ``tile_scheduler_metadata[p] = [begin_req, end_req, begin_block, end_block (exclusive),
begin_split, first_req_split, last_req_split, 0]`` (the two flags are one OR-ed flag when the
part holds one request), and ``num_splits = [0, cumsum(pieces_i)]``. Parts after the last block
hold ``[batch, batch - 1, 0, n_(batch-1), 0, 0, 0, 0]``, as the library writes them; the
decode skips those parts.

Importing this module imports no Triton (:func:`.triton_common.jit_in_place`).
"""

from __future__ import annotations

import torch

from .. import dispatch
from . import triton_common

#: FlashMLA's SM90 sparse-decode scheduling constants (``Decode_Sm90_Impl::get_meta``).
BLOCK = 64
OVERHEAD = 5
#: Requests per vector step, and warps of the one program.
CHUNK = 32
NUM_WARPS = 4

triton = tl = None  # bound by _triton()
_BLOCK, _OVERHEAD, _FAR = BLOCK, OVERHEAD, 2**30
_CONSTEXPRS = ("_BLOCK", "_OVERHEAD", "_FAR")


def _lay(n, i, batch, part, used, payload, room, inv_room, first_part, last_part, first_blocks):
    """Lay request ``i`` (``n`` blocks; nothing past the batch) from ``(part, used units)``: store
    its first part, last part and blocks in its first part; return the state after it. If it does
    not fit it leaves ``over`` blocks for the parts after its first, ``ceil(over / room)`` of them:
    the quotient from the float reciprocal, corrected (exact for ``over < 2^24``), since an
    integer division would set the pace of this serial chain."""
    live = i < batch
    over = used + n + _OVERHEAD - payload
    skip = (over > 0) & (used >= room)  # does not fit, and no block would: the next part
    first = tl.where(skip, part + 1, part)  # its first part
    over = tl.where(skip, over - used, over)
    start = tl.where(skip, 0, used)
    q = ((over - 1).to(tl.float32) * inv_room).to(tl.int32)  # (over - 1) // room, +-1
    q += tl.where((over - 1) - q * room >= room, 1, 0) - tl.where((over - 1) - q * room < 0, 1, 0)
    more = tl.where(over > 0, q + 1, 0)  # parts after the first
    tl.store(first_part + i, first, mask=live)
    tl.store(last_part + i, first + more, mask=live)
    tl.store(first_blocks + i, n - tl.maximum(over, 0), mask=live)  # all of them if they fit
    after = tl.where(more == 0, start + n + _OVERHEAD, over - q * room + _OVERHEAD)
    return tl.where(live, first + more, part), tl.where(live, after, used)


def _schedule_kernel(
    topk_length, extra_topk_length, meta, num_splits, work,
    batch, parts, topk, extra_topk, length_stride, extra_length_stride,
    HAS_LENGTH: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_EXTRA_LENGTH: tl.constexpr,
    CHUNK: tl.constexpr, PARTS: tl.constexpr,
):
    # work: int32 [4, batch]: blocks, first part, last part, blocks in the first part
    blocks, first_part, last_part, first_blocks = work, work + batch, work + 2 * batch, work + 3 * batch
    offs = tl.arange(0, CHUNK)

    # 1. blocks per request; the payload of a part
    # (while loops: the interpreter cannot range() over an int argument)
    cost = tl.zeros([CHUNK], tl.int32)
    start = batch * 0
    while start < batch:
        r = start + offs
        live = r < batch
        if HAS_LENGTH:
            keys = tl.load(topk_length + r * length_stride, mask=live, other=0)
        else:
            keys = tl.zeros([CHUNK], tl.int32) + topk
        keys = tl.where(keys == 0, 1, keys)
        if HAS_EXTRA:
            keys = (keys + _BLOCK - 1) // _BLOCK * _BLOCK
            if HAS_EXTRA_LENGTH:
                keys += tl.load(extra_topk_length + r * extra_length_stride, mask=live, other=0)
            else:
                keys += extra_topk
        n = tl.maximum(keys - 1, 0) // _BLOCK + 1
        tl.store(blocks + r, n, mask=live)
        cost += tl.where(live, n + _OVERHEAD, 0)
        start += CHUNK
    total = tl.sum(cost, axis=0)
    payload = (total + parts - 1) // parts + _OVERHEAD
    room = payload - _OVERHEAD  # blocks of one request a part holds (>= 1)
    tl.debug_barrier()

    # 2. lay the requests in order (_lay), four per step: the next four block counts are loaded
    #    while these are laid, so the serial chain waits on no load
    inv_room = 1.0 / room.to(tl.float32)
    part = total * 0
    used = total * 0
    i = batch * 0
    n0 = tl.load(blocks + i, mask=i < batch, other=0)
    n1 = tl.load(blocks + i + 1, mask=i + 1 < batch, other=0)
    n2 = tl.load(blocks + i + 2, mask=i + 2 < batch, other=0)
    n3 = tl.load(blocks + i + 3, mask=i + 3 < batch, other=0)
    while i < batch:
        m0 = tl.load(blocks + i + 4, mask=i + 4 < batch, other=0)
        m1 = tl.load(blocks + i + 5, mask=i + 5 < batch, other=0)
        m2 = tl.load(blocks + i + 6, mask=i + 6 < batch, other=0)
        m3 = tl.load(blocks + i + 7, mask=i + 7 < batch, other=0)
        part, used = _lay(n0, i, batch, part, used, payload, room, inv_room, first_part, last_part, first_blocks)
        part, used = _lay(n1, i + 1, batch, part, used, payload, room, inv_room, first_part, last_part, first_blocks)
        part, used = _lay(n2, i + 2, batch, part, used, payload, room, inv_room, first_part, last_part, first_blocks)
        part, used = _lay(n3, i + 3, batch, part, used, payload, room, inv_room, first_part, last_part, first_blocks)
        n0, n1, n2, n3 = m0, m1, m2, m3
        i += 4
    tl.debug_barrier()

    # 3. every part: its first request (the first that ends in it or later) and its last (the last
    #    that starts in it or earlier), with their block ranges in it
    p = tl.arange(0, PARTS)
    before = tl.zeros([PARTS], tl.int32)
    started = tl.zeros([PARTS], tl.int32)
    splits = total * 0
    tl.store(num_splits, splits)
    start = batch * 0
    while start < batch:
        r = start + offs
        live = r < batch
        fp = tl.load(first_part + r, mask=live, other=_FAR)
        lp = tl.load(last_part + r, mask=live, other=_FAR)
        before += tl.sum((lp[None, :] < p[:, None]).to(tl.int32), axis=1)
        started += tl.sum((fp[None, :] <= p[:, None]).to(tl.int32), axis=1)
        pieces = tl.where(live, lp - fp + 1, 0)
        tl.store(num_splits + 1 + r, splits + tl.cumsum(pieces, axis=0), mask=live)
        splits += tl.sum(pieces, axis=0)
        start += CHUNK
    begin, end = before, started - 1
    empty = begin >= batch
    b = tl.minimum(begin, batch - 1)
    b_part = tl.load(first_part + b)
    begin_block = tl.where(p == b_part, 0, tl.load(first_blocks + b) + (p - b_part - 1) * room)
    begin_block = tl.where(empty, 0, begin_block)
    begin_split = tl.where(empty, 0, p - b_part)
    e_part, e_blocks = tl.load(first_part + end), tl.load(blocks + end)
    end_block = tl.where(p >= tl.load(last_part + end), e_blocks, tl.load(first_blocks + end) + (p - e_part) * room)
    first_split = begin_split != 0  # the part's first request began in an earlier part
    last_split = end_block != e_blocks
    one = begin == end
    either = first_split | last_split
    first_split = tl.where(one, either, first_split)
    last_split = tl.where(one, either, last_split)
    row = meta + p * 8
    live = p < parts
    tl.store(row, begin, mask=live)
    tl.store(row + 1, end, mask=live)
    tl.store(row + 2, begin_block, mask=live)
    tl.store(row + 3, end_block, mask=live)
    tl.store(row + 4, begin_split, mask=live)
    tl.store(row + 5, first_split.to(tl.int32), mask=live)
    tl.store(row + 6, last_split.to(tl.int32), mask=live)
    tl.store(row + 7, begin * 0, mask=live)


_JITTED = ("_lay", "_schedule_kernel")


def _triton():
    """Import Triton and jit this module's kernel in place, once (:mod:`.triton_common`)."""
    return triton_common.jit_in_place(globals(), _CONSTEXPRS, _JITTED)


def available(device: torch.device) -> bool:
    """Whether this program can compute schedules on ``device`` (Triton present, with a backend)."""
    try:
        triton_common.require_device(_triton(), _schedule_kernel, device, "scheduler")
    except dispatch.ProviderUnavailable:
        return False
    return True


def schedule(topk_length, extra_topk_length, topk: int, extra_topk: int, meta_shape, batch: int, device):
    """FlashMLA's SM90 sparse-decode schedule: ``(tile_scheduler_metadata [parts, 8],
    num_splits [batch + 1])`` int32 on ``device``, for ``batch >= 1`` requests of ``topk`` (the
    padded index width) / ``extra_topk`` (the padded extra width, 0 without an extra cache) keys,
    ``topk_length`` / ``extra_topk_length`` ``[batch]`` int32 or ``None``. One launch, no host sync."""
    _triton()
    parts = meta_shape[0]
    meta = torch.empty(meta_shape, dtype=torch.int32, device=device)
    num_splits = torch.empty(batch + 1, dtype=torch.int32, device=device)
    work = torch.empty(4 * batch, dtype=torch.int32, device=device)
    lengths = topk_length if topk_length is not None else num_splits  # stand-ins, never read
    extra_lengths = extra_topk_length if extra_topk_length is not None else num_splits
    with triton_common.device_guard(device):
        triton_common.eager(_schedule_kernel)[(1,)](
            lengths, extra_lengths, meta, num_splits, work, batch, parts, topk, extra_topk,
            lengths.stride()[0], extra_lengths.stride()[0],
            HAS_LENGTH=topk_length is not None, HAS_EXTRA=extra_topk > 0,
            HAS_EXTRA_LENGTH=extra_topk > 0 and extra_topk_length is not None,
            CHUNK=CHUNK, PARTS=max(16, triton.next_power_of_2(parts)), num_warps=NUM_WARPS,
        )
    return meta, num_splits
