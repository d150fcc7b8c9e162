"""The Triton program of FlashMLA's SM90 sparse-decode schedule. :mod:`.schedule` launches it and
documents what it computes; importing this module imports Triton (the scheduler imports it on
first use)."""

import triton
import triton.language as tl

from . import schedule

#: Triton reads module globals in a kernel as constexprs only.
_BLOCK, _OVERHEAD = tl.constexpr(schedule.BLOCK), tl.constexpr(schedule.OVERHEAD)


@triton.jit
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


@triton.jit
def _terms(blocks, quotient, remainder, i, batch):
    """The blocks of requests ``i .. i + 3`` and their quotients and remainders by ``room``
    (``_lay``'s ``n, a, r``; 0s past the batch): a tuple of 12."""
    t = ()
    for j in tl.static_range(4):
        live = i + j < batch
        t = t + (tl.load(blocks + i + j, mask=live, other=0), tl.load(quotient + i + j, mask=live, other=0),
                 tl.load(remainder + i + j, mask=live, other=0))
    return t


@triton.jit
def _lay4(t, i, batch, part, used, payload, room, first_part, last_part, first_blocks):
    """:func:`_lay` requests ``i .. i + 3`` (``t``: their :func:`_terms`), if any is in the batch."""
    if i < batch:
        for j in tl.static_range(4):
            part, used = _lay(t[3 * j], t[3 * j + 1], t[3 * j + 2], i + j, batch, part, used, payload, room,
                              first_part, last_part, first_blocks)
    return part, used


@triton.jit
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


@triton.jit
def schedule_kernel(
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
