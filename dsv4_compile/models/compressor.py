"""The DSV4 compressor: gated softmax pooling of ``ratio`` tokens into one compressed latent.

Semantics follow SGLang ``python/sglang/srt/layers/attention/dsv4/compressor.py`` (``Compressor``:
``forward_npu`` and ``_overlap_transform``, revision 00bc152d) and its CPU variant
``compressor_cpu.py`` (revision 8a78ad53), in the natural (checkpoint) layout of ``ape``, i.e.
before the CUDA kernel's ``apply_ape_hotfix`` permutation:

* ``[kv, score] = x @ wkv_gate^T`` in float32, each ``coff * d`` wide (``coff = 2`` for ratio 4,
  else 1); ``score += ape[pos % ratio]`` (``ape [ratio, coff*d]``, float32). The layer owns
  ``wkv_gate``: it is rows of the layer's stacked input projection
  (:attr:`~.attention.DeepseekV4Attention.x_proj`), so the compressor takes the projected tokens.
* Block ``k`` (tokens ``[k*ratio, (k+1)*ratio)``) is pooled when its last token arrives:
  ``c = sum_j kv_j * softmax_j(score_j)`` (softmax over the pooled tokens, per dim).
  Ratio 128 pools the block's own tokens. Ratio 4 **overlaps**: it pools ``2*ratio`` tokens, the
  previous block's first halves ``[..., :d]`` and this block's second halves ``[..., d:]``;
  before position 0 the pooled values are ``kv = 0, score = -inf``.
* The caller normalises (RMSNorm with the float32 ``norm`` weight) and rotates the latent at the
  block's first position ``k * ratio`` (for the attention cache: through
  ``dsv4::fused_k_norm_rope_flashmla``; for the indexer keys: in PyTorch, then Hadamard-rotated
  for a quantized key cache and stored by ``dsv4::indexer_store``, :mod:`.indexer`).

State: upstream keeps each request's not-yet-pooled ``(kv, score)`` in a state pool. Here:

* ratio 4: a ring of the request's last ``S = coff*ratio`` tokens per request (``state_kv``,
  ``state_score``, module buffers), which is what the next block needs;
* other ratios: a running softmax state per request over the tokens of its unfinished block
  (``state_max``, ``state_sum``, ``state_acc`` ``[max_requests, d]``: per dim the largest score
  ``m``, ``sum_j exp(score_j - m)`` and ``sum_j kv_j * exp(score_j - m)``); the block's latent is
  ``acc / sum`` once its last token has been added. It equals the pooling of the whole block up
  to fp32 rounding (the order of the sums differs) and spares a decode step reading the ``ratio``
  tokens of every candidate block (a ring of the last 128 tokens would be 128x the state).

A step pools every block that completes in it, reading its tokens from the step itself and the
rest from the state (:meth:`Compressor.forward`); the layer then updates the state with the
step's tokens (:meth:`Compressor.remember`): fixed shapes, no data-dependent branches
(:class:`~dsv4_compile.models.metadata.CompressPlan`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .metadata import CompressPlan, Pooling, overlaps, source_window


class StepTokens(NamedTuple):
    """A step's projected tokens ``[T, coff*d]`` float32: ``kv`` and ``score`` (``ape`` added)."""

    kv: torch.Tensor
    score: torch.Tensor


class Compressor(nn.Module):
    """Pools ``ratio`` (ratio 4: ``2*ratio``, overlapping) tokens into one ``head_dim`` latent."""

    def __init__(self, head_dim: int, ratio: int, *, max_requests: int, device=None):
        super().__init__()
        self.ratio, self.head_dim = ratio, head_dim
        self.coff = 2 if overlaps(ratio) else 1
        width = self.coff * head_dim
        self.proj_width = 2 * width  # the rows of wkv_gate: kv, then score
        self.ape = nn.Parameter(torch.zeros(ratio, width, device=device, dtype=torch.float32))
        self.norm_weight = nn.Parameter(torch.ones(head_dim, device=device, dtype=torch.float32))
        if overlaps(ratio):
            ring = (max_requests + 1) * source_window(ratio)  # + a scratch request row
            self.register_buffer("state_kv", torch.zeros(ring, width, device=device))
            self.register_buffer("state_score", torch.zeros(ring, width, device=device))
        else:
            for name in ("state_max", "state_sum", "state_acc"):
                self.register_buffer(name, torch.zeros(max_requests, width, device=device))

    def forward(self, projected: torch.Tensor, plan: CompressPlan) -> tuple[torch.Tensor, StepTokens]:
        """Pooled latents ``[N, head_dim]`` float32 of the plan's candidates (zero where
        ``emit_slot`` is -1), and this step's tokens, for :meth:`remember`. ``projected``: the
        step's ``x @ wkv_gate^T`` ``[T, proj_width]`` float32."""
        kv, score = projected.split(self.coff * self.head_dim, -1)
        score = score + self.ape[plan.block_offset]
        if plan.pooled is not None:
            _, total, acc = self._running(kv, score, plan.pooled)
            latent = acc / total.clamp_min(torch.finfo(total.dtype).tiny)  # (no token: 0 / tiny)
        else:
            latent = self._from_ring(kv, score, plan)
        return latent.masked_fill((plan.emit_slot < 0)[:, None], 0.0), StepTokens(kv, score)

    def _from_ring(self, kv: torch.Tensor, score: torch.Tensor, plan: CompressPlan) -> torch.Tensor:
        """Ratio 4: each candidate's ``2*ratio`` tokens from the step or the ring, the previous
        block's first halves and this block's second halves, softmax-pooled. Each token's half is
        gathered alone (rows ``[*, 2d]`` viewed ``[*, 2, d]``, indexed by row and half): half the
        bytes of gathering whole rows, and nothing sliced or concatenated after
        (benchmarks/RESULTS.md, "Model decode step")."""
        d, r = self.head_dim, self.ratio
        # [S]: the half each pooled token contributes: 0 (the previous block's), then 1 (this one's)
        half = (torch.arange(2 * r, device=kv.device) >= r).long()
        from_step = plan.source_from_step[..., None]
        pad = plan.source_pad[..., None]

        def halves(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # [N, S, d]
            return x.unflatten(-1, (2, d))[rows, half]

        def gather(step: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
            return torch.where(from_step, halves(step, plan.source_row), halves(ring, plan.source_state))

        pooled_kv = gather(kv, self.state_kv).masked_fill(pad, 0.0)
        pooled_score = gather(score, self.state_score).masked_fill(pad, float("-inf"))
        return (pooled_kv * pooled_score.softmax(dim=1)).sum(dim=1)

    def remember(self, plan: CompressPlan, tokens: StepTokens) -> None:
        """Update the state with this step's tokens: ratio 4, write them into the ring (each
        request keeps its last ``S``); other ratios, each batch row's running state becomes
        that of its unfinished block.

        Call it after everything that uses the step's latents: the state is read by
        :meth:`forward` and written here, and a write placed before those reads' consumers lets
        Inductor's locality reordering sink the reads below it, which forces a copy of the ring.
        """
        if plan.carry is not None:
            state = self._running(tokens.kv, tokens.score, plan.carry)
            for buf, value in zip((self.state_max, self.state_sum, self.state_acc), state):
                buf[plan.carry.state] = value
            return
        self.state_kv[plan.state_index] = tokens.kv
        self.state_score[plan.state_index] = tokens.score

    def _running(self, kv: torch.Tensor, score: torch.Tensor, pooling: Pooling):
        """``(max, sum, acc)`` ``[K, d]`` of each block of ``pooling``: the request's state (where
        the block began before the step) merged with the block's tokens in the step
        (``kv``, ``score`` ``[T, d]``). An empty block: ``(-inf, 0, 0)``."""
        neg_inf = float("-inf")
        from_state = pooling.from_state[:, None]
        state_max = torch.where(from_state, self.state_max[pooling.state], neg_inf)
        state_sum = torch.where(from_state, self.state_sum[pooling.state], 0.0)
        state_acc = torch.where(from_state, self.state_acc[pooling.state], 0.0)
        step_score = score[pooling.rows].masked_fill(~pooling.from_step[..., None], neg_inf)  # [K, W, d]
        new_max = torch.maximum(state_max, step_score.amax(1))
        base = torch.where(new_max == neg_inf, 0.0, new_max)  # exp(-inf - base) = 0, never inf - inf
        weight = torch.exp(step_score - base[:, None])
        old = torch.exp(state_max - base)
        total = state_sum * old + weight.sum(1)
        acc = state_acc * old + (kv[pooling.rows] * weight).sum(1)
        return new_max, total, acc
