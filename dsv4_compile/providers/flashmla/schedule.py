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

Importing this module imports no Triton: the program is :mod:`.schedule_kernel`, imported on first use.
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

#: Schedules one launch computes (one program each).
PER_LAUNCH = 4


def _kernels():
    """The scheduler's jitted program, :mod:`.schedule_kernel` (imported with Triton on first use)."""
    return triton_common.kernels(f"{__package__}.schedule_kernel")


def available(device: torch.device) -> bool:
    """Whether this program can compute schedules on ``device`` (Triton present, with a backend)."""
    try:
        triton_common.require_device(_kernels().schedule_kernel, device, "scheduler")
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
            triton_common.eager(_kernels().schedule_kernel)[(len(group),)](
                meta[first], num_splits[first], work[first], batch, parts, *args,
                FLAGS0=flags[0], FLAGS1=flags[1], FLAGS2=flags[2], FLAGS3=flags[3], NUM=len(group),
                CHUNK=32 * NUM_WARPS, PARTS=max(32, triton_common.next_power_of_2(parts)), num_warps=NUM_WARPS,
            )
    return meta, num_splits
