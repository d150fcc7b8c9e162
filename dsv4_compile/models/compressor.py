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
  ``dsv4::fused_k_norm_rope_flashmla``; for the indexer keys: in PyTorch, then a Hadamard rotation).

State: upstream keeps each request's not-yet-pooled ``(kv, score)`` in a state pool; here a ring of
the request's last ``S = coff*ratio`` tokens per request (``state_kv``, ``state_score``, module
buffers), which is what the next block needs. A step pools every block that completes in it,
reading its tokens from the step itself or from the ring (:meth:`Compressor.forward`); the layer
then writes the step's tokens into the ring (:meth:`Compressor.remember`): fixed shapes, no
data-dependent branches (:class:`~dsv4_compile.models.metadata.CompressPlan`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .metadata import CompressPlan, overlaps, source_window


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
        ring = (max_requests + 1) * source_window(ratio)  # + a scratch request row
        self.register_buffer("state_kv", torch.zeros(ring, width, device=device))
        self.register_buffer("state_score", torch.zeros(ring, width, device=device))

    def forward(self, projected: torch.Tensor, plan: CompressPlan) -> tuple[torch.Tensor, StepTokens]:
        """Pooled latents ``[N, head_dim]`` float32 of the plan's candidates (zero where
        ``emit_slot`` is -1), and this step's tokens, for :meth:`remember`. ``projected``: the
        step's ``x @ wkv_gate^T`` ``[T, proj_width]`` float32."""
        width, d, r = self.coff * self.head_dim, self.head_dim, self.ratio
        kv, score = projected.split(width, -1)
        score = score + self.ape[plan.block_offset]

        from_step = plan.source_from_step[..., None]
        pooled_kv = torch.where(from_step, kv[plan.source_row], self.state_kv[plan.source_state])
        pooled_score = torch.where(
            from_step, score[plan.source_row], self.state_score[plan.source_state]
        )
        pad = plan.source_pad[..., None]
        pooled_kv = pooled_kv.masked_fill(pad, 0.0)
        pooled_score = pooled_score.masked_fill(pad, float("-inf"))
        if self.coff == 2:  # previous block's first halves, then this block's second halves
            pooled_kv = torch.cat([pooled_kv[:, :r, :d], pooled_kv[:, r:, d:]], dim=1)
            pooled_score = torch.cat([pooled_score[:, :r, :d], pooled_score[:, r:, d:]], dim=1)
        latent = (pooled_kv * pooled_score.softmax(dim=1)).sum(dim=1)
        return latent.masked_fill((plan.emit_slot < 0)[:, None], 0.0), StepTokens(kv, score)

    def remember(self, plan: CompressPlan, tokens: StepTokens) -> None:
        """Write this step's tokens into the state ring (each request keeps its last ``S``).

        Call it after everything that uses the step's latents: the ring is read by
        :meth:`forward` and written here, and a write placed before those reads' consumers lets
        Inductor's locality reordering sink the reads below it, which forces a copy of the ring.
        """
        self.state_kv[plan.state_index] = tokens.kv
        self.state_score[plan.state_index] = tokens.score
