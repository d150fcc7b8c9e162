"""FlashMLA's sparse-decode schedule (``get_mla_metadata``'s two tensors) from one Triton program.

FlashMLA's SM90 sparse decode spreads the key blocks of a batch over ``num_sm_parts`` parts (one
per group of SMs); its scheduler, a one-thread CUDA kernel that visits the parts one after the
other, writes what each part computes. The library runs that kernel only inside its decode, so
asking it for a schedule takes a decode over a dummy cache
(:meth:`.adapter.FlashMLAKernels.library_schedule`, where this program is not used: SM100,
``sgl_kernel``): on the H200 ~35 us per call in a CUDA graph at batch 1, against ~3 us here. This
program computes the same tensors, bit for bit (``tests/test_flashmla_schedule.py`` compares them
with the library's on the GPU), in one launch: the requests one after the other (a serial chain
of a few integer operations per request, no division on it), then every part at once (from
histograms of the parts where the requests start and end).

Several schedules of one step (:func:`schedules`; the model's layer kinds, ``dsv4::get_mla_metadata_stacked``)
run side by side, one program each, up to :data:`PER_LAUNCH` per launch: a step's three kinds cost
one launch and about the time of the longest (6.5 us at batch 64 on the H200, against 19.4 us for
three launches).

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

Importing this module imports no Triton (:func:`.triton.common.jit_in_place`).
"""

from __future__ import annotations

import torch

from ... import dispatch
from ..triton import common as triton_common

#: FlashMLA's SM90 sparse-decode scheduling constants (``Decode_Sm90_Impl::get_meta``).
BLOCK = 64
OVERHEAD = 5
#: Warps of the one program; it takes a request per thread in its vector steps.
NUM_WARPS = 4

triton = tl = None  # bound by _triton()
_BLOCK, _OVERHEAD = BLOCK, OVERHEAD
_CONSTEXPRS = ("_BLOCK", "_OVERHEAD")


def _lay(n, a, r, i, batch, part, used, payload, room, first_part, last_part, first_blocks):
    """Lay request ``i`` (``n`` blocks; nothing past the batch) from ``(part, used units)``: store
    its first part, last part and blocks in its first part; return the state after it.

    If it does not fit it leaves ``over = used + n + OVERHEAD - payload`` blocks for the parts
    after its first, ``ceil(over / room)`` of them. With ``n - 1 = a * room + r`` (step 2 of the
    kernel), ``over - 1 = (a - 1) * room + (used + r)`` and ``used + r < 2 * room``, so one
    comparison gives that count: no division sets the pace of this serial chain. Past the batch
    it stores nothing; the state it returns then is not used."""
    live = i < batch
    k = n + _OVERHEAD - payload
    skip = (used + k > 0) & (used >= room)  # does not fit, and no block would: the next part
    used = tl.where(skip, 0, used)
    first = part + skip.to(tl.int32)  # its first part
    over = used + k
    t = used + r
    wrap = t >= room
    more = tl.where(over > 0, a + wrap.to(tl.int32), 0)  # parts after the first
    after = tl.where(over > 0, tl.where(wrap, t - room, t) + 1 + _OVERHEAD, over + payload)
    tl.store(first_part + i, first, mask=live)
    tl.store(last_part + i, first + more, mask=live)
    tl.store(first_blocks + i, n - tl.maximum(over, 0), mask=live)  # all of them if they fit
    return first + more, after


def _terms(blocks, quotient, remainder, i, batch):
    """The blocks of requests ``i .. i + 3`` and their quotients and remainders by ``room``
    (``_lay``'s ``n, a, r``; 0s past the batch): a tuple of 12."""
    t = ()
    for j in tl.static_range(4):
        live = i + j < batch
        t = t + (tl.load(blocks + i + j, mask=live, other=0), tl.load(quotient + i + j, mask=live, other=0),
                 tl.load(remainder + i + j, mask=live, other=0))
    return t


def _lay4(t, i, batch, part, used, payload, room, first_part, last_part, first_blocks):
    """:func:`_lay` requests ``i .. i + 3`` (``t``: their :func:`_terms`), if any is in the batch."""
    if i < batch:
        for j in tl.static_range(4):
            part, used = _lay(t[3 * j], t[3 * j + 1], t[3 * j + 2], i + j, batch, part, used, payload, room,
                              first_part, last_part, first_blocks)
    return part, used


def _schedule(
    topk_length, extra_topk_length, meta, num_splits, work,
    batch, parts, topk, extra_topk, length_stride, extra_length_stride,
    FLAGS: tl.constexpr, CHUNK: tl.constexpr, PARTS: tl.constexpr,
):
    """One schedule. ``FLAGS``: bit 0 ``topk_length`` given, bit 1 an extra cache
    (``extra_topk > 0``), bit 2 ``extra_topk_length`` given."""
    HAS_LENGTH: tl.constexpr = (FLAGS & 1) != 0
    HAS_EXTRA: tl.constexpr = (FLAGS & 2) != 0
    HAS_EXTRA_LENGTH: tl.constexpr = (FLAGS & 4) != 0
    # work: int32 [6, batch]: blocks, (blocks - 1) // room and (blocks - 1) % room (_lay's n, a, r),
    # first part, last part, blocks in the first part
    blocks, quotient, remainder = work, work + batch, work + 2 * batch
    first_part, last_part, first_blocks = work + 3 * batch, work + 4 * batch, work + 5 * batch
    offs = tl.arange(0, CHUNK)  # CHUNK = the program's threads: no element held twice

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

    # 2. _lay's quotient and remainder, every request at once: n - 1 = a * room + r, 0 <= r < room
    start = batch * 0
    while start < batch:
        r = start + offs
        live = r < batch
        dividend = tl.load(blocks + r, mask=live, other=1) - 1
        a = dividend // room
        tl.store(quotient + r, a, mask=live)
        tl.store(remainder + r, dividend - a * room, mask=live)
        start += CHUNK
    tl.debug_barrier()

    # 3. lay the requests in order (_lay), eight per step in two groups of four; each group's
    #    terms are loaded while the other group is laid, so the serial chain seldom waits on a load
    part = total * 0
    used = total * 0
    i = batch * 0
    t0, t1 = _terms(blocks, quotient, remainder, i, batch), _terms(blocks, quotient, remainder, i + 4, batch)
    while i < batch:
        part, used = _lay4(t0, i, batch, part, used, payload, room, first_part, last_part, first_blocks)
        t0 = _terms(blocks, quotient, remainder, i + 8, batch)
        part, used = _lay4(t1, i + 4, batch, part, used, payload, room, first_part, last_part, first_blocks)
        t1 = _terms(blocks, quotient, remainder, i + 12, batch)
        i += 8
    tl.debug_barrier()

    # 4. every part: its first request (the first that ends in it or later: the requests ending
    #    before it, counted) and its last (the last that starts in it or earlier: the requests
    #    starting in it or before, counted, minus one), with their block ranges in it; the counts
    #    from histograms of the requests' first and last parts (parts past the last are not
    #    counted: no part reads them)
    p = tl.arange(0, PARTS)
    ending = tl.zeros([PARTS], tl.int32)
    starting = tl.zeros([PARTS], tl.int32)
    splits = total * 0
    tl.store(num_splits, splits)
    start = batch * 0
    while start < batch:
        r = start + offs
        live = r < batch
        fp = tl.load(first_part + r, mask=live, other=0)
        lp = tl.load(last_part + r, mask=live, other=0)
        starting += tl.histogram(fp, PARTS, mask=live & (fp < PARTS))
        ending += tl.histogram(lp, PARTS, mask=live & (lp < PARTS))
        pieces = tl.where(live, lp - fp + 1, 0)
        tl.store(num_splits + 1 + r, splits + tl.cumsum(pieces, axis=0), mask=live)
        splits += tl.sum(pieces, axis=0)
        start += CHUNK
    begin = tl.cumsum(ending, axis=0) - ending
    end = tl.cumsum(starting, axis=0) - 1
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


def _schedule_kernel(
    meta, num_splits, work, batch, parts,
    lengths0, extra_lengths0, topk0, extra_topk0, stride0, extra_stride0,
    lengths1, extra_lengths1, topk1, extra_topk1, stride1, extra_stride1,
    lengths2, extra_lengths2, topk2, extra_topk2, stride2, extra_stride2,
    lengths3, extra_lengths3, topk3, extra_topk3, stride3, extra_stride3,
    FLAGS0: tl.constexpr, FLAGS1: tl.constexpr, FLAGS2: tl.constexpr, FLAGS3: tl.constexpr,
    NUM: tl.constexpr, CHUNK: tl.constexpr, PARTS: tl.constexpr,
):
    # program k computes schedule k (of NUM <= 4) into the k-th [parts, 8] / [batch + 1] / [6, batch]
    # of meta / num_splits / work; the schedules are independent, so they run side by side
    k = tl.program_id(0)
    meta += k * parts * 8
    num_splits += k * (batch + 1)
    work += k * 6 * batch
    if k == 0:
        _schedule(lengths0, extra_lengths0, meta, num_splits, work, batch, parts, topk0, extra_topk0,
                  stride0, extra_stride0, FLAGS0, CHUNK, PARTS)
    if NUM > 1:
        if k == 1:
            _schedule(lengths1, extra_lengths1, meta, num_splits, work, batch, parts, topk1, extra_topk1,
                      stride1, extra_stride1, FLAGS1, CHUNK, PARTS)
    if NUM > 2:
        if k == 2:
            _schedule(lengths2, extra_lengths2, meta, num_splits, work, batch, parts, topk2, extra_topk2,
                      stride2, extra_stride2, FLAGS2, CHUNK, PARTS)
    if NUM > 3:
        if k == 3:
            _schedule(lengths3, extra_lengths3, meta, num_splits, work, batch, parts, topk3, extra_topk3,
                      stride3, extra_stride3, FLAGS3, CHUNK, PARTS)


#: Schedules one launch computes (one program each).
PER_LAUNCH = 4
_JITTED = ("_lay", "_terms", "_lay4", "_schedule", "_schedule_kernel")


def _triton():
    """Import Triton and jit this module's kernel in place, once (:mod:`.triton.common`)."""
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
    meta, num_splits = schedules([(topk_length, extra_topk_length, topk, extra_topk)], meta_shape, batch, device)
    return meta[0], num_splits[0]


def schedules(problems, meta_shape, batch: int, device):
    """:func:`schedule` for each of ``problems``, ``(topk_length, extra_topk_length, topk,
    extra_topk)`` tuples, stacked: ``(tile_scheduler_metadata [K, parts, 8], num_splits
    [K, batch + 1])``. One launch per :data:`PER_LAUNCH` schedules, one program each."""
    _triton()
    count, parts = len(problems), meta_shape[0]
    meta = torch.empty(count, *meta_shape, dtype=torch.int32, device=device)
    num_splits = torch.empty(count, batch + 1, dtype=torch.int32, device=device)
    work = torch.empty(count, 6 * batch, dtype=torch.int32, device=device)
    with triton_common.device_guard(device):
        for first in range(0, count, PER_LAUNCH):
            group = problems[first : first + PER_LAUNCH]
            args, flags = [], []
            for topk_length, extra_topk_length, topk, extra_topk in group:
                has_extra = extra_topk > 0
                lengths = topk_length if topk_length is not None else num_splits  # stand-ins, never read
                extra_lengths = extra_topk_length if has_extra and extra_topk_length is not None else num_splits
                args += [lengths, extra_lengths, topk, extra_topk, lengths.stride()[0], extra_lengths.stride()[0]]
                flags.append((topk_length is not None) | has_extra << 1 | (has_extra and extra_topk_length is not None) << 2)
            for _ in range(len(group), PER_LAUNCH):  # absent schedules: never run (NUM)
                args += [num_splits, num_splits, 0, 0, 0, 0]
                flags.append(0)
            triton_common.eager(_schedule_kernel)[(len(group),)](
                meta[first], num_splits[first], work[first], batch, parts, *args,
                FLAGS0=flags[0], FLAGS1=flags[1], FLAGS2=flags[2], FLAGS3=flags[3], NUM=len(group),
                CHUNK=32 * NUM_WARPS, PARTS=max(32, triton.next_power_of_2(parts)), num_warps=NUM_WARPS,
            )
    return meta, num_splits
