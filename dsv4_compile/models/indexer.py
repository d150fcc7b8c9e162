"""The lightning indexer of ratio-4 layers: which compressed blocks each query attends to.

Semantics follow SGLang ``python/sglang/srt/layers/attention/dsv4/indexer.py`` (``C4Indexer``,
``fp8_paged_mqa_logits_torch``, ``_topk_transform_512_vectorized``, revision 00509fc3) and the
PyTorch reference of its fused query kernel (``fused_q_indexer_rope_hadamard_quant_torch``):

* query: ``q = wq_b(q_lora)`` ``[T, H_i, 128]`` (``q_lora`` is the attention's normed
  ``q_lora``), interleaved RoPE on its last 64 dims at the token position (the layer's table),
  then the normalised Walsh-Hadamard rotation (``x @ H / sqrt(128)``; quantized formats only);
  no norm; quantized as the key cache's format.
* head weights: ``w = weights_proj(x) * 128**-0.5 * H_i**-0.5``.
* keys: a second ratio-4 (overlapping) :class:`Compressor` of width 128 pools the block (its
  ``wkv_gate`` is rows of the layer's stacked input projection); the
  latent is RMSNorm-ed (float32 weight), RoPE-d at the block's first position, Hadamard-rotated
  (quantized formats only), quantized and stored (op ``dsv4::indexer_store``).
* logits over the request's visible blocks ``k < (pos+1)//4``:
  ``l[t, k] = sum_h w[t, h] * relu(<q[t, h], K_k>)`` (docs/design.md §2.11), reading only those
  blocks' keys.
* selection: all visible blocks in order when there are at most ``index_topk`` of them, else the
  ``index_topk`` best (docs/design.md §2.9: in block order, equal logits to the lower block, the
  same indices on every provider); ``-1`` pads to the fixed width. Scored and selected in one op,
  ``dsv4::indexer_cache_topk`` (§2.12), through the page table: a step holds no ``[T, context]``
  slots or logits, whatever the context.
* tensor parallelism (:mod:`.parallel`): each rank scores with its share of the heads and the
  logits are all-reduced before the selection, so every rank selects the same blocks: there the
  logits are a tensor (``dsv4::indexer_cache_logits`` over ``[T, max_blocks]`` slots, then
  ``dsv4::indexer_topk``), whose size grows with the context.

The key cache (``CacheConfig.index_format``, docs/design.md §2.11) is paged as the c4 cache (the
same slots, ``page_size / 4`` blocks a page): ``"fp8"`` (the default, as SGLang) or ``"fp4"``
rotate keys and queries by the Hadamard transform (:func:`layout.hadamard`) and quantize them as
SGLang's indexer does (per key / per (token, head) for FP8, with the query's scale folded into its
head weight; per 32 values for FP4); ``"fp32"`` keeps exact float32 keys and queries, unrotated
(the rotation keeps dot products: ``<q H, k H> = <q, k>``), so its selection is the
exact-arithmetic top-k. Deviations: the rotation here is float32 butterflies, where SGLang's FP4
query kernel rounds to bf16 after RoPE and after the rotation; the scores sum exact products in
float32 (bf16 operands on tensor cores), not DeepGEMM's FP8 MMA.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import invariance, layout
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
        self.format = layout.indexer_format(cache.index_format)
        self.page_size = cache.compressed_page_size(RATIO)
        self.register_buffer(
            "key_cache", layout.alloc_index_cache(cache.num_pages, self.page_size, self.format, device)
        )

    def forward(
        self, x: torch.Tensor, q_lora: torch.Tensor, projected: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, StepTokens]:
        """Selected block ids ``[T, index_topk]`` int64 (``-1`` = none), after storing the keys of
        the blocks this step completes; and the compressor's step tokens (for ``remember``).
        ``projected``: the step's projection for the key compressor (``x @ wkv_gate^T``, float32,
        from the layer's stacked input projection)."""
        plan = meta.plans[RATIO]
        latent, tokens = self.compressor(projected, plan)
        fmt, name = self.format, self.format.name
        key = rope_last(
            rms_norm(latent, self.compressor.norm_weight, self.eps), self.freqs, plan.emit_pos, in_place=True
        )
        if fmt.rotated:
            key = layout.hadamard(key)
        torch.ops.dsv4.indexer_store(key, self.key_cache, plan.emit_slot, self.page_size, name)  # -1: none

        q = self.wq_b(q_lora).view(-1, self.heads, self.head_dim)
        q = rope_last(q, self.freqs, meta.positions)  # [T, H_i, D_i] fp32
        weights = self.weights_proj(x).float() * self.weight_scale  # [T, H_i]
        if fmt.rotated:
            q = layout.hadamard(q)
        q, q_scales = layout.quantize_index(q, fmt)
        if fmt.values == "fp8":  # the query's scale rides on its head weight (relu(s x) = s relu(x))
            weights, q_scales = weights * q_scales, None
        return self.select(q, weights, q_scales, plan), tokens

    def select(self, q: torch.Tensor, weights: torch.Tensor, q_scales: torch.Tensor | None, plan) -> torch.Tensor:
        """Top-``index_topk`` block ids ``[T, index_topk]`` of the quantized queries ``q`` (and
        ``q_scales``) with head ``weights`` over each query's visible blocks, in block order, ties
        to the lower block, ``-1`` padded; every visible block where there are at most
        ``index_topk``. Reads only the visible blocks' keys."""
        order = torch.arange(self.topk, device=q.device)
        in_order = torch.where(order < plan.lengths[:, None], order, -1)  # every visible block
        if plan.max_blocks <= self.topk:
            return in_order
        name, invariant = self.format.name, invariance.enabled()
        if self.tp.size == 1:  # scored and selected in one op: no [T, max_blocks] slots or logits
            return torch.ops.dsv4.indexer_cache_topk(
                q, weights, self.key_cache, plan.page_table, plan.rows, plan.lengths, self.page_size, self.topk,
                name, q_scales, invariant,
            )
        # tensor parallel: each rank scores with its heads, the logits are summed over the ranks
        # before the selection (-inf, not visible, stays -inf), so every rank selects the same blocks
        slots = layout.visible_slots(plan.page_table, plan.rows, plan.lengths, plan.per_page, plan.max_blocks)
        logits = torch.ops.dsv4.indexer_cache_logits(
            q, weights, self.key_cache, slots, self.page_size, name, q_scales, invariant
        )
        best = torch.ops.dsv4.indexer_topk(self.tp.all_reduce(logits), self.topk)  # block order; ties to the lower
        return torch.where(plan.lengths[:, None] <= self.topk, in_order, best)
