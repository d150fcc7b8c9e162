"""FlashMLA's SM90 sparse-decode schedule from our Triton program
(``dsv4_compile/providers/flashmla/schedule.py``; the rule is in its docstring).

Where it runs: CPU under ``TRITON_INTERPRET=1`` (the ``device="cpu"`` cases, in the child pytest of
:func:`test_interpreted_suite`, as in ``test_triton_store.py``), and CUDA (``cuda`` marker), where
the schedule is also compared with the one FlashMLA's own scheduler writes.

* hand-worked schedules: expected tensors worked out from the rule, step by step, in the tests;
* every schedule of random lengths lays each request's blocks once, in order, over the parts,
  with no part holding more than its payload, and flags and split counts that say so;
* on an SM90 GPU with sgl-flash-mla: the same tensors, bit for bit, as FlashMLA's scheduler run by
  the library (a decode over a dummy cache), over random shapes and lengths.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")

from dsv4_compile.providers.flashmla import adapter as flashmla, schedule as flashmla_schedule  # noqa: E402
from helpers import run_interpreted_child  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if INTERPRETED else [pytest.param("cuda", marks=pytest.mark.cuda)]
BLOCK, OVERHEAD = flashmla_schedule.BLOCK, flashmla_schedule.OVERHEAD


def schedule(device, lengths, width, parts, extra_lengths=None, extra_width=0, batch=None):
    """Our schedule for ``[batch]`` lengths (lists, or ``None``: every request attends the width)."""
    batch = len(lengths) if batch is None else batch
    as_tensor = (lambda v: None if v is None else torch.tensor(v, dtype=torch.int32, device=device))
    meta, splits = flashmla_schedule.schedule(
        as_tensor(lengths), as_tensor(extra_lengths), width, extra_width, (parts, 8), batch, torch.device(device))
    return meta.tolist(), splits.tolist()


def blocks_of(batch, lengths, width, extra_lengths, extra_width):
    """Blocks per request, by the rule (keys: the length, at least 1; with an extra cache rounded up
    to a block, plus the extra length)."""
    out = []
    for i in range(batch):
        keys = max(lengths[i] if lengths is not None else width, 1)
        if extra_width:
            keys = -(-keys // BLOCK) * BLOCK + (extra_lengths[i] if extra_lengths is not None else extra_width)
        out.append(-(-keys // BLOCK))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_one_request_is_spread_one_block_per_part(device):
    """1 request of 640 keys (10 blocks) over 132 parts: payload ceil(15 / 132) + 5 = 6 units, so a
    part holds one block. Parts 0-9 take block p each (one request split in both directions: both
    flags set); parts 10-131 are empty: [batch, batch - 1, 0, n_(batch-1), 0, 0, 0, 0]."""
    meta, splits = schedule(device, None, 640, 132, batch=1)
    assert meta[:10] == [[0, 0, p, p + 1, p, 1, 1, 0] for p in range(10)]
    assert meta[10:] == [[1, 0, 0, 10, 0, 0, 0, 0]] * 122
    assert splits == [0, 10]


@pytest.mark.parametrize("device", DEVICES)
def test_requests_split_shared_and_moved_to_the_next_part(device):
    """Blocks [10, 1, 10] over 4 parts: payload ceil(36 / 4) + 5 = 14 units, 9 blocks after a
    piece's overhead.

    * request 0 does not fit (10 + 5 > 14): blocks 0-8 in part 0, block 9 in part 1 (6 units used);
    * request 1 fits in part 1 (6 + 1 + 5 = 12 units);
    * request 2 does not fit, and 2 units left are not more than the overhead: it starts in part 2,
      blocks 0-8 there and block 9 in part 3.
    """
    meta, splits = schedule(device, [640, 64, 640], 640, 4)
    assert meta == [
        [0, 0, 0, 9, 0, 1, 1, 0],   # request 0's first piece: split after (one request: both flags)
        [0, 1, 9, 1, 1, 1, 0, 0],   # request 0's second piece (split 1), then request 1 whole
        [2, 2, 0, 9, 0, 1, 1, 0],
        [2, 2, 9, 10, 1, 1, 1, 0],
    ]
    assert splits == [0, 2, 3, 5]


@pytest.mark.parametrize("device", DEVICES)
def test_zero_lengths_and_extra_keys(device):
    """Lengths [10, 0] of width 64 with an extra cache of width 128, extra lengths [128, 0]:
    request 0 attends 64 (10 rounded up to a block) + 128 keys = 3 blocks, request 1 at least 1
    key, rounded up to 64, + 0 = 1 block. Payload ceil(14 / 2) + 5 = 12: request 0 in part 0
    (8 units); request 1 needs 6 units, 4 are left: it moves to part 1."""
    meta, splits = schedule(device, [10, 0], 64, 2, extra_lengths=[128, 0], extra_width=128)
    assert meta == [[0, 0, 0, 3, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0, 0, 0]]
    assert splits == [0, 1, 2]


def check_schedule(meta, splits, blocks, parts):
    """The schedule lays every request's blocks once, in order, in pieces of parts in order; no
    part holds more than the payload; the split counts and flags say where requests were split."""
    batch = len(blocks)
    payload = -(-sum(n + OVERHEAD for n in blocks) // parts) + OVERHEAD
    done = [0] * batch  # blocks of each request laid so far
    pieces = [0] * batch
    last = -1  # the last request laid
    for p, (begin, end, begin_block, end_block, begin_split, first_split, last_split, pad) in enumerate(meta):
        assert pad == 0
        if begin == batch:  # empty: every later part too
            assert all(done[i] == blocks[i] for i in range(batch)), (p, done)
            assert [end, begin_block, end_block, begin_split, first_split, last_split] == [
                batch - 1, 0, blocks[-1], 0, 0, 0]
            continue
        assert begin in (last, last + 1) and begin <= end < batch, (p, begin, end, last)
        units = 0
        for r in range(begin, end + 1):
            start = begin_block if r == begin else 0
            stop = end_block if r == end else blocks[r]
            assert start == done[r] and start < stop <= blocks[r], (p, r, start, stop, done[r])
            if r == begin:
                assert begin_split == pieces[r]
            done[r], pieces[r] = stop, pieces[r] + 1
            units += OVERHEAD + stop - start
        assert units <= payload, (p, units, payload)
        split_before, split_after = begin_block != 0, end_block != blocks[end]
        if begin == end:
            split_before = split_after = split_before or split_after
        assert (first_split, last_split) == (split_before, split_after), p
        last = end
    assert done == blocks
    assert splits[0] == 0 and [splits[i + 1] - splits[i] for i in range(batch)] == pieces


@pytest.mark.parametrize("device", DEVICES)
def test_random_schedules_lay_every_block_once(device):
    rng = random.Random(0)
    for _ in range(40 if device == "cpu" else 400):
        batch = rng.choice([1, 2, 3, 7, 8, 9, 31, 32, 33, 64, 100, 129, 300])
        parts = rng.choice([1, 2, 7, 33, 66, 132])
        width = rng.choice([64, 128, 512, 1024])
        extra_width = rng.choice([0, 64, 512])
        lengths = [rng.randint(0, width) for _ in range(batch)] if rng.random() < 0.8 else None
        extra = [rng.randint(0, extra_width) for _ in range(batch)] if extra_width and rng.random() < 0.8 else None
        meta, splits = schedule(device, lengths, width, parts, extra, extra_width, batch)
        check_schedule(meta, splits, blocks_of(batch, lengths, width, extra, extra_width), parts)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_lengths(device):
    lengths = torch.tensor([[700, 1], [3, 1], [1000, 1]], dtype=torch.int32, device=device)[:, 0]
    got = flashmla_schedule.schedule(lengths, None, 1024, 0, (7, 8), 3, torch.device(device))
    want = schedule(device, [700, 3, 1000], 1024, 7)
    assert [t.tolist() for t in got] == list(want)


def random_problems(rng, device, batch, count):
    """``count`` random ``(topk_length, extra_topk_length, width, extra_width)`` schedules."""
    problems = []
    for _ in range(count):
        width, extra_width = rng.choice([64, 128, 640, 1024]), rng.choice([0, 0, 64, 512])
        lengths = torch.tensor([rng.randint(0, width) for _ in range(batch)], dtype=torch.int32, device=device)
        extra = torch.tensor([rng.randint(0, extra_width) for _ in range(batch)], dtype=torch.int32, device=device)
        problems.append((lengths if rng.random() < 0.8 else None,
                         extra if extra_width and rng.random() < 0.8 else None, width, extra_width))
    return problems


@pytest.mark.parametrize("device", DEVICES)
def test_stacked_schedules_equal_one_at_a_time(device):
    """Several schedules from one launch (up to four programs side by side; more in further
    launches): each equal to the schedule computed alone."""
    rng = random.Random(2)
    for _ in range(12 if device == "cpu" else 30):
        batch, parts = rng.choice([1, 3, 33, 64, 129]), rng.choice([1, 7, 132])
        problems = random_problems(rng, device, batch, rng.choice([1, 2, 3, 4, 5, 9]))
        meta, splits = flashmla_schedule.schedules(problems, (parts, 8), batch, torch.device(device))
        assert meta.shape == (len(problems), parts, 8) and splits.shape == (len(problems), batch + 1)
        for k, problem in enumerate(problems):
            alone = flashmla_schedule.schedule(*problem, (parts, 8), batch, torch.device(device))
            assert torch.equal(meta[k], alone[0]) and torch.equal(splits[k], alone[1]), (k, batch, parts)


@pytest.mark.cuda
def test_the_stacked_op_equals_the_op_per_entry():
    """``dsv4::get_mla_metadata_stacked`` on CUDA (FlashMLA's provider: one launch on SM90, the
    library per entry elsewhere): entry k is ``get_mla_metadata`` for indices of its widths."""
    pytest.importorskip("flash_mla")
    import dsv4_compile as d4

    device = torch.device("cuda")
    rng = random.Random(3)
    for case in range(8):  # each new combination of schedules compiles a program: few cases
        batch, heads = rng.choice([1, 8, 64, 100]), rng.choice([64, 128])
        q = torch.zeros(batch, 1, heads, 512, dtype=torch.bfloat16, device=device)
        problems = random_problems(rng, device, batch, rng.choice([1, 3, 5]))
        meta, splits = d4.get_mla_metadata_stacked(
            q, [p[2] for p in problems], [p[0] for p in problems], [p[3] for p in problems], [p[1] for p in problems])
        for k, (lengths, extra_lengths, width, extra_width) in enumerate(problems):
            idx = torch.zeros(batch, 1, width, dtype=torch.int32, device=device)
            extra_idx = torch.zeros(batch, 1, extra_width, dtype=torch.int32, device=device) if extra_width else None
            want = d4.get_mla_metadata(q, idx, lengths, extra_idx, extra_lengths)
            assert torch.equal(meta[k], want[0]) and torch.equal(splits[k], want[1]), (case, k)


@pytest.mark.cuda
def test_equals_the_librarys_scheduler():
    """Our schedule and FlashMLA's (its decode over a dummy cache), on the GPU, bit for bit."""
    pytest.importorskip("flash_mla")
    device = torch.device("cuda")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the schedule is FlashMLA's SM90 one")
    kernels = flashmla._load_flash_mla(device)["get_mla_metadata"].__self__
    assert kernels.own_schedule
    rng = random.Random(1)
    for case in range(300):
        batch = rng.choice([1, 2, 3, 8, 33, 64, 129, 512])
        s_q = rng.choice([1, 1, 2, 4])
        heads = rng.choice([16, 64, 128])
        width, extra_width = rng.choice([32, 64, 128, 640, 2048]), rng.choice([0, 0, 64, 128, 512])
        q = torch.zeros(batch, s_q, heads, 512, dtype=torch.bfloat16, device=device)
        idx = torch.zeros(batch, s_q, width, dtype=torch.int32, device=device)
        lengths = torch.randint(0, width + 1, (batch,), dtype=torch.int32, device=device) if rng.random() < 0.8 else None
        extra_idx = extra_lengths = None
        if extra_width:
            extra_idx = torch.zeros(batch, s_q, extra_width, dtype=torch.int32, device=device)
            if rng.random() < 0.8:
                extra_lengths = torch.randint(0, extra_width + 1, (batch,), dtype=torch.int32, device=device)
        ours = kernels.get_mla_metadata(q, idx, lengths, extra_idx, extra_lengths)
        library = kernels.library_schedule(q, idx, lengths, extra_idx, extra_lengths)
        assert torch.equal(ours[0], library[0]) and torch.equal(ours[1], library[1]), (
            case, batch, s_q, heads, width, extra_width)


def test_interpreted_suite(request):
    """Run the CPU cases in a child pytest with ``TRITON_INTERPRET=1``."""
    run_interpreted_child(request.config, __file__)
