"""The lightning indexer of ratio-4 layers: which compressed blocks each query attends to.

Semantics follow SGLang ``python/sglang/srt/layers/attention/dsv4/indexer.py`` (``C4Indexer``,
``fp8_paged_mqa_logits_torch``, ``_topk_transform_512_vectorized``, revision 00509fc3) and the
PyTorch reference of its fused query kernel (``fused_q_indexer_rope_hadamard_quant_torch``):

* query: ``q = wq_b(q_lora)`` ``[T, H_i, 128]`` (``q_lora`` is the attention's normed
  ``q_lora``), interleaved RoPE on its last 64 dims at the token position (the layer's table),
  then the normalised Walsh-Hadamard rotation (``x @ H / sqrt(128)``); no norm (no rotation
  here: see Deviations).
* head weights: ``w = weights_proj(x) * 128**-0.5 * H_i**-0.5``.
* keys: a second ratio-4 (overlapping) :class:`Compressor` of width 128 pools the block (its
  ``wkv_gate`` is rows of the layer's stacked input projection); the
  latent is RMSNorm-ed (float32 weight), RoPE-d at the block's first position, Hadamard-rotated
  (not here).
* logits over the request's visible blocks ``k < (pos+1)//4``:
  ``l[t, k] = sum_h w[t, h] * relu(<q[t, h], K_k>)``: op ``dsv4::indexer_logits``
  (docs/design.md §2.8), which reads only those blocks' keys.
* tensor parallelism (:mod:`.parallel`): each rank scores with its share of the heads and the
  logits are all-reduced before the selection, so every rank selects the same blocks.
* selection: all visible blocks in order when there are at most ``index_topk`` of them, else the
  ``index_topk`` best (op ``dsv4::indexer_topk``, docs/design.md §2.9: in block order, equal
  logits to the lower block, the same indices on every provider); ``-1`` pads to the fixed width.

Deviations: upstream quantizes queries and keys to FP8 (per-(token, head) and per-key scales)
before the logits; here both stay float32 (the op scores them in float32, or 3xTF32 on NVIDIA
tensor cores, ~float32), and the key cache is a float32 buffer addressed by c4 slots (its last row
is scratch for candidates that store nothing). Selection is therefore the
exact-arithmetic top-k, which FP8 can perturb near ties. And without FP8 there is nothing for the
Hadamard rotation to do: it rotates queries and keys alike, and an orthonormal rotation keeps
their dot products, ``<q H, k H> = <q, k>``; upstream applies it to spread outliers before
quantizing. So neither is rotated (two float32 GEMMs per step fewer), the logits equal the
rotated ones up to float32 rounding, and the key buffer holds unrotated keys.
"""

from __future__ import annotations

import torch
from torch import nn

from .compressor import Compressor, StepTokens
from .config import CacheConfig, DeepseekV4Config
from .metadata import StepMetadata
from .norm import rms_norm
from .parallel import SINGLE, TensorParallel, shard_
from .rope import rope_last

RATIO = 4


class Indexer(nn.Module):
    """Scores the compressed blocks of a ratio-4 layer and returns the top-k per query."""

    def __init__(
        self,
        config: DeepseekV4Config,
        cache: CacheConfig,
        freqs: torch.Tensor,
        *,
        device=None,
        dtype=torch.bfloat16,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.tp = tp
        self.heads = tp.split("index_n_heads", config.index_n_heads)  # this rank's
        self.head_dim = config.index_head_dim
        self.topk, self.eps = config.index_topk, config.rms_norm_eps
        self.weight_scale = self.head_dim**-0.5 * config.index_n_heads**-0.5
        self.wq_b = nn.Linear(
            config.q_lora_rank, self.heads * self.head_dim, bias=False, device=device, dtype=dtype
        )
        self.weights_proj = nn.Linear(
            config.hidden_size, self.heads, bias=False, device=device, dtype=dtype
        )
        shard_(self.wq_b, weight=0)
        shard_(self.weights_proj, weight=0)
        self.compressor = Compressor(self.head_dim, RATIO, max_requests=cache.max_requests, device=device)
        self.register_buffer("freqs", freqs, persistent=False)
        slots = cache.num_pages * cache.compressed_page_size(RATIO)
        self.register_buffer("keys", torch.zeros(slots + 1, self.head_dim, device=device))

    def forward(
        self, x: torch.Tensor, q_lora: torch.Tensor, projected: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, StepTokens]:
        """Selected block ids ``[T, index_topk]`` int64 (``-1`` = none), after storing the keys of
        the blocks this step completes; and the compressor's step tokens (for ``remember``).
        ``projected``: the step's projection for the key compressor (``x @ wkv_gate^T``, float32,
        from the layer's stacked input projection)."""
        plan = meta.plans[RATIO]
        latent, tokens = self.compressor(projected, plan)
        key = rope_last(
            rms_norm(latent, self.compressor.norm_weight, self.eps), self.freqs, plan.emit_pos, in_place=True
        )
        scratch = self.keys.shape[0] - 1
        self.keys[torch.where(plan.emit_slot >= 0, plan.emit_slot, scratch)] = key

        q = self.wq_b(q_lora).view(-1, self.heads, self.head_dim)
        q = rope_last(q, self.freqs, meta.positions)  # [T, H_i, D_i] fp32
        weights = self.weights_proj(x).float() * self.weight_scale  # [T, H_i]
        # only the visible blocks' keys are read (the op; -inf where a block is not visible);
        # -inf summed over ranks stays -inf
        logits = self.tp.all_reduce(torch.ops.dsv4.indexer_logits(q, weights, self.keys, plan.block_slots))
        return self.select(logits, plan.lengths), tokens

    def select(self, logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Top-``index_topk`` block ids of ``logits [T, M]`` (``-inf`` = not visible), ``-1`` padded."""
        num_blocks = logits.shape[1]
        order = torch.arange(self.topk, device=logits.device)
        in_order = torch.where(order < lengths[:, None], order, -1)  # every visible block
        if num_blocks <= self.topk:
            return in_order
        best = torch.ops.dsv4.indexer_topk(logits, self.topk)  # in block order; ties to the lower block
        return torch.where(lengths[:, None] <= self.topk, in_order, best)
