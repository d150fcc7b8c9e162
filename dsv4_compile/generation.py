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

@dataclass
class Batch:
    """Running requests: tokens so far; request ``i`` owns page-table row ``i``."""

    tokens: list[list[int]]

    @property
    def seq_lens(self) -> list[int]:
        return [len(t) for t in self.tokens]


def step_inputs(chunks: Sequence[Sequence[int]], starts: Sequence[int], device) -> dict:
    """Step inputs that feed batch row ``b`` the tokens ``chunks[b]`` at positions
    ``starts[b], starts[b] + 1, ...`` (request ``b`` owns page-table row ``b``)."""

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return dict(
        input_ids=as_tensor([t for c in chunks for t in c]),
        positions=as_tensor([s + i for c, s in zip(chunks, starts) for i in range(len(c))]),
        batch_index=as_tensor([b for b, c in enumerate(chunks) for _ in c]),
        seq_lens=as_tensor([s + len(c) for c, s in zip(chunks, starts)]),
        req_slots=torch.arange(len(chunks), device=device),
    )


def prefill_inputs(prompts: Sequence[Sequence[int]], device) -> dict:
    """Step inputs that prefill every prompt (one batch row each)."""
    return step_inputs(prompts, [0] * len(prompts), device)


def decode_inputs(batch: Batch, device) -> dict:
    """Step inputs that feed each request its last token (at position ``len - 1``)."""
    return step_inputs([t[-1:] for t in batch.tokens], [n - 1 for n in batch.seq_lens], device)


@torch.no_grad()
def generate(
    prefill: Callable[..., torch.Tensor],
    decode: Callable[..., torch.Tensor],
    prompts: Sequence[Sequence[int]],
    steps: int,
    device,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
) -> list[list[int]]:
    """Greedy generation: ``prefill(**inputs, mode="prefill")`` once, then ``steps`` calls of
    ``decode(**inputs, mode="decode")``; returns each request's generated tokens.

    ``on_step(step, logits)`` sees the logits of every step (0 = prefill).
    """
    logits = prefill(**prefill_inputs(prompts, device), mode="prefill")
    batch = Batch([list(p) + [t] for p, t in zip(prompts, logits.argmax(-1).tolist())])
    if on_step is not None:
        on_step(0, logits)
    for step in range(1, steps + 1):
        logits = decode(**decode_inputs(batch, device), mode="decode")
        if on_step is not None:
            on_step(step, logits)
        for tokens, t in zip(batch.tokens, logits.argmax(-1).tolist()):
            tokens.append(t)
    return [t[len(p):] for t, p in zip(batch.tokens, prompts)]
