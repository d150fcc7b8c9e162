"""``DeepseekV4Attention``: one DSV4 attention layer over the ``dsv4`` ops (docs/design.md §4).

Math per step (upstream: SGLang ``python/sglang/srt/models/deepseek_v4.py`` ``MQALayer``,
revision 000328a8), ``T`` tokens, ``H`` heads, ``D = 512``. The projections of ``x`` that every
rank holds (``wq_a``, ``wkv`` and the compressors' ``wkv_gate``) are rows of one weight,
``x_proj`` (:meth:`DeepseekV4Attention.x_weight` names them), read by one GEMM per step
(:func:`~.linear.linear_split`: ``wq_a`` and ``wkv`` rounded to bf16, the compressors' in float32).

1. ``q_lora = RMSNorm(wq_a x)``; ``q = wq_b q_lora`` ``[T, H, D]``; per-head unweighted RMSNorm,
   then RoPE on dims 448..511 at the token position.
2. ``kv = wkv x`` ``[T, D]`` -> ``dsv4::fused_k_norm_rope_flashmla`` (``kv_norm`` weight) into the
   window cache at ``swa_slots``, in the cache format of :class:`~.config.CacheConfig` (V4, or
   V4.1 with FP8 or FP4 compressed caches).
3. ``compress_ratio > 0``: the :class:`~.compressor.Compressor` pools the blocks completing in this
   step into the compressed cache through the same store op (float32 latent, float32 ``norm``
   weight, RoPE at the block's first position; page size ``page_size / ratio``). Ratio 4: the
   :class:`~.indexer.Indexer` selects ``index_topk`` blocks per query; ratio 128: every completed
   block (up to ``max_seq_len / 128``).
4. Sparse attention, softmax scale ``D**-0.5``, learned ``attn_sink [H]``: window keys (newest
   first, ``sliding_window`` of them) plus the selected compressed keys. ``"decode"`` mode:
   ``dsv4::flash_mla_with_kvcache`` with the compressed keys as ``extra_*``; ``"prefill"`` mode:
   ``dsv4::flash_mla_sparse_fwd`` over a workspace dequantized from both caches.
5. Inverse RoPE on the output's dims 448..511; grouped low-rank output projection: group ``g`` of
   ``o_groups`` takes heads ``[g*H/G, (g+1)*H/G)`` through its slice of ``wo_a``; then ``wo_b``
   (under tensor parallelism, :mod:`.parallel`, each rank's part, then an all-reduce).
6. The compressors' states take this step's tokens, last (:meth:`.Compressor.remember`).

RoPE tables: ``rope_theta`` for ratio-0 layers, ``compress_rope_theta`` with YaRN for compressed
layers (:mod:`.rope`); a layer uses its table for q, the window keys, the compressed keys and the
inverse rotation alike. Caches, compressor states and indexer keys are module buffers allocated
once (:class:`~.config.CacheConfig`), so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import layout, ops
from .compressor import Compressor
from .config import CacheConfig, DeepseekV4Config, check_cache_fits
from .indexer import Indexer
from .linear import linear_split
from .metadata import StepMetadata, counts_are_apart
from .norm import RMSNorm, rms_norm
from .parallel import SINGLE, TensorParallel, shard_
from .rope import layer_rope_table, rope_last


#: the oldest torch whose ``torch.export`` traces the transposed output of ``wo_a``'s GEMM with a
#: dynamic token count (:meth:`DeepseekV4Attention._grouped_low_rank`)
TRANSPOSED_EXPORT_TORCH = "2.13"
_TRANSPOSED_EXPORT = torch.torch_version.TorchVersion(torch.__version__) >= TRANSPOSED_EXPORT_TORCH


class DeepseekV4Attention(nn.Module):
    """One DSV4 attention layer of kind ``compress_ratio`` (0, 4 or 128) with its own caches.

    ``tp``: tensor parallelism (:mod:`.parallel`): this rank's share of the query heads, output
    groups and indexer heads; the output is all-reduced over the group. ``reuse_selection``
    (ratio 4): attend the blocks the step's previous ratio-4 layer selected instead of running this
    layer's indexer (``DeepseekV4Config.index_reuse``)."""

    def __init__(
        self,
        config: DeepseekV4Config,
        compress_ratio: int,
        cache: CacheConfig,
        *,
        device=None,
        dtype=torch.bfloat16,
        tp: TensorParallel = SINGLE,
        reuse_selection: bool = False,
    ):
        super().__init__()
        if compress_ratio not in (0, 4, 128):
            raise ValueError(f"compress_ratio must be 0, 4 or 128, got {compress_ratio}")
        check_cache_fits(config, cache)
        if reuse_selection and compress_ratio != 4:
            raise ValueError(f"reuse_selection is for ratio-4 layers (the indexer's), got compress_ratio {compress_ratio}")
        self.compress_ratio = compress_ratio
        #: attend the blocks an earlier ratio-4 layer of the step selected (``StepMetadata.selection``)
        #: instead of running this layer's indexer (``DeepseekV4Config.index_reuse``)
        self.reuse_selection = reuse_selection
        self.tp = tp
        self.heads = tp.split("num_attention_heads", config.num_attention_heads)  # this rank's
        self.groups = tp.split("o_groups", config.o_groups)
        self.o_lora_rank, self.eps = config.o_lora_rank, config.rms_norm_eps
        self.page_size = cache.page_size
        self.kv_format = cache.cache_format(0)  # the window cache
        self.compressed_format = cache.cache_format(compress_ratio) if compress_ratio else None
        self.softmax_scale = layout.HEAD_DIM**-0.5
        hidden, d = config.hidden_size, layout.HEAD_DIM
        linear = dict(bias=False, device=device, dtype=dtype)

        self.q_norm = RMSNorm(config.q_lora_rank, self.eps, device=device, dtype=dtype)
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * d, **linear)
        self.kv_norm = RMSNorm(d, self.eps, device=device, dtype=dtype)
        self.wo_a = nn.Linear(self.heads * d // self.groups, self.groups * self.o_lora_rank, **linear)
        self.wo_b = nn.Linear(self.groups * self.o_lora_rank, hidden, **linear)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, device=device, dtype=torch.float32))
        shard_(self.wq_b, weight=0)  # the rank's heads
        shard_(self.wo_a, weight=0)  # the rank's output groups
        shard_(self.wo_b, weight=1)  # row-parallel: a partial sum per rank
        shard_(self, attn_sink=0)

        # one table per (config, layer kind, device), shared by the layers of that kind
        freqs = layer_rope_table(config, compress_ratio, device)
        self.register_buffer("freqs", freqs, persistent=False)
        self.register_buffer(
            "swa_cache", layout.alloc_cache(cache.num_pages, cache.page_size, device, kv_format=self.kv_format)
        )
        self.compressor = self.indexer = None
        if compress_ratio:
            self.compressed_page_size = cache.compressed_page_size(compress_ratio)
            self.compressor = Compressor(d, compress_ratio, max_requests=cache.max_requests, device=device)
            self.register_buffer("compressed_cache", layout.alloc_cache(
                cache.num_pages, self.compressed_page_size, device, kv_format=self.compressed_format,
            ))
        if compress_ratio == 4:
            self.indexer = Indexer(config, cache, freqs, device=device, dtype=dtype, tp=tp)
        #: the decode's extra index width (0: no extra cache): the indexer's top-k, or every block
        self.extra_width = (
            config.index_topk if compress_ratio == 4 else cache.max_blocks(compress_ratio) if compress_ratio else 0
        )

        # every projection of x that is replicated across ranks, stacked: one GEMM reads them all
        widths = {"wq_a": config.q_lora_rank, "wkv": d}  # bf16 outputs, then float32 ones:
        if self.compressor is not None:
            widths["compressor.wkv_gate"] = self.compressor.proj_width
        if self.indexer is not None:
            widths["indexer.compressor.wkv_gate"] = self.indexer.compressor.proj_width
        self.x_rows, start = {}, 0
        for name, width in widths.items():
            self.x_rows[name], start = slice(start, start + width), start + width
        self.x_proj = nn.Linear(hidden, start, **linear)

    def forward(self, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; stores this step's keys into the layer's caches."""
        positions = meta.positions
        proj = self._x_parts(x)
        q_lora = self.q_norm(proj["wq_a"])
        # no name holds wq_b's bf16 output: rms_norm's float32 copy frees it (an eager prefill's peak)
        q = rms_norm(self.wq_b(q_lora).unflatten(-1, (self.heads, layout.HEAD_DIM)), None, self.eps)
        q = rope_last(q, self.freqs, positions, dtype=x.dtype)
        ops.fused_k_norm_rope_flashmla(
            proj["wkv"], self.kv_norm.weight, self.freqs, positions, meta.swa_slots,
            self.swa_cache, self.eps, self.page_size, self.kv_format,
        )

        blocks = None
        remember = []  # compressor rings are written last (Compressor.remember)
        if self.compressor is not None:
            plan = meta.plans[self.compress_ratio]
            latent, tokens = self.compressor(proj["compressor.wkv_gate"], plan)
            remember.append((self.compressor, plan, tokens))
            ops.fused_k_norm_rope_flashmla(
                latent, self.compressor.norm_weight, self.freqs, plan.emit_pos, plan.emit_slot,
                self.compressed_cache, self.eps, self.compressed_page_size, self.compressed_format,
            )
            if self.reuse_selection:
                if meta.selection is None:
                    raise ValueError("reuse_selection: no ratio-4 layer selected blocks earlier in this step")
                blocks = meta.selection
            elif self.indexer is not None:
                blocks, tokens = self.indexer(x, q_lora, proj["indexer.compressor.wkv_gate"], meta)
                remember.append((self.indexer.compressor, plan, tokens))
                meta.selection = blocks
            else:  # ratio 128: every visible block
                k = torch.arange(plan.max_blocks, device=x.device)
                blocks = torch.where(k < plan.lengths[:, None], k, -1)

        attend = self._decode if meta.mode == "decode" else self._prefill
        out = attend(q, meta, blocks)  # [T, H, D] bf16
        ops.rope_(out, self.freqs, positions, inverse=True)  # in place: only the 64 rotated dims move
        out = self.tp.all_reduce(self.wo_b(self._grouped_low_rank(out)))
        for compressor, plan, tokens in remember:
            compressor.remember(plan, tokens)
        return out

    def _grouped_low_rank(self, out: torch.Tensor) -> torch.Tensor:
        """``out [T, H, D]`` through ``wo_a``, group ``g`` taking its heads' block: ``[T, G * o_lora_rank]``.

        One batched GEMM of ``wo_a``'s ``[G, o_lora_rank, H*D/G]`` blocks with ``[G, H*D/G, T]``
        views of ``out``, which writes ``[G * o_lora_rank, T]`` contiguous: its transpose is a
        column-major operand ``wo_b``'s GEMM reads as it is, so no copy runs between the two GEMMs
        (a ``[G, T, o_lora_rank]`` output needed one: benchmarks/RESULTS.md, "Model decode step").
        Traced for ``torch.export`` (:func:`~.metadata.counts_apart`) on torch before
        :data:`TRANSPOSED_EXPORT_TORCH`: that output and its copy, because there ``torch.export``
        fails on a guard of the transposed output's strides (``min(T, 64 T) == T``) that it cannot
        prove for a dynamic token count ``T`` (seen on torch 2.10 and 2.11)."""
        width = self.heads * layout.HEAD_DIM // self.groups
        wo_a = self.wo_a.weight.view(self.groups, self.o_lora_rank, width)
        grouped = out.view(-1, self.groups, width)  # [T, G, H*D/G]
        if counts_are_apart() and not _TRANSPOSED_EXPORT:
            return torch.bmm(grouped.transpose(0, 1), wo_a.transpose(1, 2)).transpose(0, 1).flatten(1)
        return torch.bmm(wo_a, grouped.permute(1, 2, 0)).flatten(0, 1).t()

    def x_weight(self, name: str) -> torch.Tensor:
        """The rows of :attr:`x_proj` that are the projection ``name`` (a key of :attr:`x_rows`:
        ``wq_a``, ``wkv``, ``compressor.wkv_gate``, ``indexer.compressor.wkv_gate``); a view."""
        return self.x_proj.weight[self.x_rows[name]]

    def _x_parts(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``x``'s projections by name (:attr:`x_rows`), from one GEMM (:func:`~.linear.linear_split`):
        ``wq_a`` and ``wkv`` (the first two) in ``x``'s dtype, the compressors' in float32."""
        widths = [rows.stop - rows.start for rows in self.x_rows.values()]
        projected, projected_fp32 = linear_split(x, self.x_proj.weight, self.x_rows["wkv"].stop)
        parts = (*projected.split(widths[:2], -1), *projected_fp32.split(widths[2:], -1))
        return dict(zip(self.x_rows, parts))

    def _decode(self, q: torch.Tensor, meta: StepMetadata, blocks: torch.Tensor | None) -> torch.Tensor:
        extra = dict(extra_k_cache=None, extra_page_size=1, extra_indices=None, extra_topk_length=None,
                     extra_kv_format=None)
        if blocks is not None:
            plan = meta.plans[self.compress_ratio]
            extra = dict(
                extra_k_cache=self.compressed_cache,
                extra_page_size=self.compressed_page_size,
                extra_indices=plan.slots(blocks).int().unsqueeze(1),
                extra_topk_length=plan.visible(blocks.shape[1]),
                extra_kv_format=self.compressed_format,
            )
        q = q.unsqueeze(1)  # one query row per token: [T, 1, H, D]
        metadata, splits = meta.scheduler(
            self.compress_ratio, q, meta.window_indices, meta.window_lengths,
            extra["extra_indices"], extra["extra_topk_length"],
        )
        out, _ = ops.flash_mla_with_kvcache(
            q, self.swa_cache, self.page_size, meta.window_indices, meta.window_lengths,
            self.attn_sink, **extra, tile_scheduler_metadata=metadata, num_splits=splits,
            softmax_scale=self.softmax_scale, kv_format=self.kv_format,
        )
        return out.squeeze(1)

    def _prefill(self, q: torch.Tensor, meta: StepMetadata, blocks: torch.Tensor | None) -> torch.Tensor:
        workspace = layout.dequant_workspace(
            self.swa_cache, self.page_size, meta.window_workspace_slots, self.kv_format
        )
        indices = meta.window_indices
        if blocks is not None:
            plan = meta.plans[self.compress_ratio]
            base = workspace.shape[0] + meta.batch_index[:, None] * plan.max_blocks
            rows = torch.where(blocks >= 0, base + blocks, -1).int().unsqueeze(1)
            compressed = layout.dequant_workspace(
                self.compressed_cache, self.compressed_page_size, plan.workspace_slots, self.compressed_format
            )
            workspace = torch.cat([workspace, compressed])
            indices = torch.cat([indices, rows], dim=-1)
        out, _, _ = ops.flash_mla_sparse_fwd(
            q, workspace, indices, self.softmax_scale, attn_sink=self.attn_sink
        )
        return out
