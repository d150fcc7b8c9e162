"""Step inputs and greedy generation, for any step function: the model, a compiled model, or a
loaded AOTInductor package (:mod:`dsv4_compile.export`).

A step is described by five int64 tensors: ``input_ids [T]``, ``positions [T]``, ``batch_index
[T]`` (the batch row of each token; a row's tokens are contiguous, at consecutive positions),
``seq_lens [B]`` (lengths after the step) and ``req_slots [B]`` (the request's row of the page
table). Nothing here imports the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

@dataclass(frozen=True)
class StepLimits:
    """The bounds of a model's step inputs: token ids below ``vocab_size``; positions below the
    RoPE tables' ``max_position_embeddings`` and the cache's ``max_seq_len`` (the smaller,
    :attr:`max_position`); request slots below ``max_requests``. An input past one would index
    past a table on the device (on CUDA a device-side assert, which ends every request of the
    process), so the step builders here check them on the host before any kernel runs, and the
    model checks its tensors in checked mode. A step function carries its limits as a
    ``step_limits`` attribute (the model and a compiled model do)."""

    vocab_size: int
    max_position_embeddings: int
    max_seq_len: int
    max_requests: int

    @property
    def max_position(self) -> int:
        """One past the largest position a step may hold."""
        return min(self.max_position_embeddings, self.max_seq_len)

    def _position_bound(self) -> str:
        return (f"below {self.max_position} (max_position_embeddings {self.max_position_embeddings}, "
                f"CacheConfig.max_seq_len {self.max_seq_len}: the smaller)")

    def check_rows(self, chunks: Sequence[Sequence[int]], starts: Sequence[int], slots: Sequence[int]) -> None:
        """Batch row ``b`` feeds the token ids ``chunks[b]`` at positions ``starts[b] ...`` of
        request ``slots[b]``: ``ValueError`` naming the first input past its bound, the bound and
        the value (host values, no device work)."""
        for b, (chunk, start, slot) in enumerate(zip(chunks, starts, slots)):
            if len(chunk):
                low, high = min(chunk), max(chunk)
                if low < 0 or high >= self.vocab_size:
                    bad = low if low < 0 else high
                    raise ValueError(f"input_ids must be in [0, {self.vocab_size}) (the vocabulary), "
                                     f"got {bad} in batch row {b}")
                last = start + len(chunk) - 1
                if start < 0 or last >= self.max_position:
                    raise ValueError(f"positions must be >= 0 and {self._position_bound()}, "
                                     f"got {start if start < 0 else last} in batch row {b}")
            if not 0 <= slot < self.max_requests:
                raise ValueError(f"req_slots must be in [0, {self.max_requests}) (CacheConfig.max_requests), "
                                 f"got {slot} in batch row {b}")

    def check(self, input_ids: torch.Tensor, positions: torch.Tensor, req_slots: torch.Tensor) -> None:
        """The same bounds on a step's tensors (a device sync: checked mode)."""
        for name, values, low, high, bound in (
            ("input_ids", input_ids, 0, self.vocab_size, f"in [0, {self.vocab_size}) (the vocabulary)"),
            ("positions", positions, 0, self.max_position, f">= 0 and {self._position_bound()}"),
            ("req_slots", req_slots, 0, self.max_requests,
             f"in [0, {self.max_requests}) (CacheConfig.max_requests)"),
        ):
            outside = ((values < low) | (values >= high)).nonzero()
            if outside.numel():
                i = int(outside[0, 0])
                raise ValueError(f"{name} must be {bound}, got {int(values[i])} at index {i}")


def step_limits(step) -> StepLimits | None:
    """The input bounds a step function carries (its ``step_limits`` attribute), else ``None``."""
    limits = getattr(step, "step_limits", None)
    return limits if isinstance(limits, StepLimits) else None


@dataclass
class Batch:
    """Running requests: tokens so far; request ``i`` owns page-table row ``i``."""

    tokens: list[list[int]]

    @property
    def seq_lens(self) -> list[int]:
        return [len(t) for t in self.tokens]


def random_prompts(vocab_size: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, token ids uniform in ``[0, vocab_size)`` from ``seed`` (drawn
    in order, so the same arguments give the same prompts everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def step_inputs(
    chunks: Sequence[Sequence[int]],
    starts: Sequence[int],
    device,
    slots: Sequence[int] | None = None,
    limits: StepLimits | None = None,
) -> dict:
    """Step inputs that feed batch row ``b`` the tokens ``chunks[b]`` at positions
    ``starts[b], starts[b] + 1, ...`` of request ``slots[b]`` (its page-table row; default ``b``).
    ``limits``: the model's :class:`StepLimits`, checked here on the host first."""
    if limits is not None:
        limits.check_rows(chunks, starts, range(len(chunks)) if slots is None else slots)

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return dict(
        input_ids=as_tensor([t for c in chunks for t in c]),
        positions=as_tensor([s + i for c, s in zip(chunks, starts) for i in range(len(c))]),
        batch_index=as_tensor([b for b, c in enumerate(chunks) for _ in c]),
        seq_lens=as_tensor([s + len(c) for c, s in zip(chunks, starts)]),
        req_slots=torch.arange(len(chunks), device=device) if slots is None else as_tensor(list(slots)),
    )


def prefill_inputs(prompts: Sequence[Sequence[int]], device, limits: StepLimits | None = None) -> dict:
    """Step inputs that prefill every prompt (one batch row each); ``limits`` checked first."""
    return step_inputs(prompts, [0] * len(prompts), device, limits=limits)


def prefill_chunks(prompts: Sequence[Sequence[int]], chunk_tokens: int) -> list[list[tuple[int, int, int]]]:
    """Chunked prefill: the steps that prefill ``prompts`` with at most ``chunk_tokens`` tokens
    each, as ``(request, start, count)`` rows (request ``r`` is fed ``prompts[r][start:start + count]``).
    Requests are taken in order and a step packs as many as fit, so a long prompt spans several
    steps and short ones share a step; every step but the last holds exactly ``chunk_tokens``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    empty = [r for r, p in enumerate(prompts) if not len(p)]
    if empty:
        raise ValueError(f"prompts must not be empty, got empty prompts at {empty}")
    steps, rows, room = [], [], chunk_tokens
    for r, prompt in enumerate(prompts):
        start = 0
        while start < len(prompt):
            count = min(len(prompt) - start, room)
            rows.append((r, start, count))
            start, room = start + count, room - count
            if not room:
                steps.append(rows)
                rows, room = [], chunk_tokens
    return steps + [rows] if rows else steps


@torch.no_grad()
def prefill_prompts(
    step: Callable[..., torch.Tensor],
    prompts: Sequence[Sequence[int]],
    device,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Prefill every prompt (request ``r`` in page-table row ``r``) with ``step(**inputs,
    mode="prefill")``: in one step, or in steps of at most ``chunk_tokens`` tokens
    (:func:`prefill_chunks`), which bounds the step's activations whatever the prompts' lengths.
    Returns the logits of each prompt's last token ``[len(prompts), vocab]``. The inputs are
    checked against ``step``'s :class:`StepLimits` (:func:`step_limits`) before a step runs."""
    limits = step_limits(step)
    if limits is not None:  # every prompt before the first step: a refused chunk would leave a prompt half stored
        limits.check_rows(prompts, [0] * len(prompts), range(len(prompts)))
    if chunk_tokens is None:
        return step(**prefill_inputs(prompts, device, limits), mode="prefill")
    last = [None] * len(prompts)
    for rows in prefill_chunks(prompts, chunk_tokens):
        inputs = step_inputs(
            [prompts[r][start:start + count] for r, start, count in rows], [start for _, start, _ in rows],
            device, slots=[r for r, _, _ in rows], limits=limits,
        )
        logits = step(**inputs, mode="prefill")
        for row, (r, start, count) in enumerate(rows):
            if start + count == len(prompts[r]):  # the prompt's last token is in this step
                last[r] = logits[row]
    return torch.stack(last)


def decode_inputs(batch: Batch, device, limits: StepLimits | None = None) -> dict:
    """Step inputs that feed each request its last token (at position ``len - 1``); ``limits``
    checked first."""
    return step_inputs([t[-1:] for t in batch.tokens], [n - 1 for n in batch.seq_lens], device, limits=limits)


@torch.no_grad()
def generate(
    prefill: Callable[..., torch.Tensor],
    decode: Callable[..., torch.Tensor],
    prompts: Sequence[Sequence[int]],
    steps: int,
    device,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
    chunk_tokens: int | None = None,
    follow: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Greedy generation: the prompts' prefill (:func:`prefill_prompts`: one step of
    ``prefill(**inputs, mode="prefill")``, or steps of at most ``chunk_tokens`` tokens), then
    ``steps`` calls of ``decode(**inputs, mode="decode")``; returns each request's generated tokens.

    ``on_step(step, logits)`` sees the logits of every step (0 = the prompts' last tokens).

    ``follow``: each request's tokens to feed instead of the greedy ones (at least ``steps``
    each; teacher forcing), so two models can be compared step by step on the same inputs even
    where a near-tie makes their greedy choices differ; the greedy choices are still returned.
    """
    if follow is not None and (len(follow) != len(prompts) or min(map(len, follow), default=steps) < steps):
        raise ValueError(f"follow must hold at least steps ({steps}) tokens for each of the {len(prompts)} "
                         f"prompts, got lengths {[len(f) for f in follow]}")
    limits = step_limits(decode) or step_limits(prefill)
    logits = prefill_prompts(prefill, prompts, device, chunk_tokens)
    chosen = [[t] for t in logits.argmax(-1).tolist()]
    fed = chosen if follow is None else follow  # the token fed after step s: fed[r][s]
    batch = Batch([list(p) + [f[0]] for p, f in zip(prompts, fed)])
    if on_step is not None:
        on_step(0, logits)
    for step in range(1, steps + 1):
        logits = decode(**decode_inputs(batch, device, limits), mode="decode")
        if on_step is not None:
            on_step(step, logits)
        for r, t in enumerate(logits.argmax(-1).tolist()):
            chosen[r].append(t)
            if step < steps:
                batch.tokens[r].append(fed[r][step])
    return chosen


def choice_margins(
    logits: Sequence[torch.Tensor], chosen: Sequence[Sequence[int]], other: Sequence[Sequence[int]]
) -> list[float]:
    """Where ``other``'s greedy tokens differ from ``chosen`` (the run whose ``logits`` of every
    step these are, as :func:`generate` returns and ``on_step`` sees them: ``logits[i][r]`` chose
    ``chosen[r][i]``), how far below the top logit ``other``'s token lies: 0 for an exact tie,
    small for a near-tie that rounding can flip."""
    margins = []
    for i, step in enumerate(logits):
        for r, row in enumerate(step.float()):
            if chosen[r][i] != other[r][i]:
                margins.append((row.max() - row[other[r][i]]).item())
    return margins

