"""A small DSV4 language model around :class:`DeepseekV4Attention`, and a greedy generation loop.

Not DSV4's full decoder: it has the DSV4 attention block of each layer kind, pre-norm residual
layers with an optional small SwiGLU MLP (DSV4's MoE and hyper-connections are out of scope), an
embedding and an LM head, random weights from a seed. Its purpose is to run real prefill and decode
steps through the ``dsv4`` ops, eagerly and under ``torch.compile``.

A step is ``model(input_ids, positions, batch_index, seq_lens, req_slots, mode=...)``: the step
metadata is built inside ``forward`` (once, shared by every layer), so one ``torch.compile`` of the
model captures the whole step in one graph. It returns the float32 logits of each batch row's last
token ``[B, vocab]``. Requests own fixed rows of the page table (``req_slots``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .attention import DeepseekV4Attention
from .config import CacheConfig, DeepseekV4Config
from .metadata import build_step_metadata
from .norm import RMSNorm


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate x) * up x)``."""

    def __init__(self, hidden: int, intermediate: int, *, device=None, dtype=torch.bfloat16):
        super().__init__()
        linear = dict(bias=False, device=device, dtype=dtype)
        self.gate = nn.Linear(hidden, intermediate, **linear)
        self.up = nn.Linear(hidden, intermediate, **linear)
        self.down = nn.Linear(intermediate, hidden, **linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    """``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, config, compress_ratio, cache, *, device=None, dtype=torch.bfloat16):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_norm = RMSNorm(config.hidden_size, eps, device=device, dtype=dtype)
        self.attn = DeepseekV4Attention(config, compress_ratio, cache, device=device, dtype=dtype)
        self.mlp = None
        if config.intermediate_size:
            self.post_attention_norm = RMSNorm(config.hidden_size, eps, device=device, dtype=dtype)
            self.mlp = MLP(config.hidden_size, config.intermediate_size, device=device, dtype=dtype)

    def forward(self, h: torch.Tensor, meta) -> torch.Tensor:
        h = h + self.attn(self.input_norm(h), meta)
        if self.mlp is not None:
            h = h + self.mlp(self.post_attention_norm(h))
        return h


class DeepseekV4Model(nn.Module):
    """Embedding, ``num_hidden_layers`` DSV4 layers, final norm, LM head; seeded random weights."""

    def __init__(
        self,
        config: DeepseekV4Config,
        cache: CacheConfig,
        *,
        seed: int = 0,
        device=None,
        dtype=torch.bfloat16,
    ):
        super().__init__()
        self.config, self.cache = config, cache
        ratios = config.compress_ratios[: config.num_hidden_layers]
        self.compressed_ratios = tuple(sorted({r for r in ratios if r}))
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, r, cache, device=device, dtype=dtype) for r in ratios
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype
        )
        pages = torch.arange(cache.num_pages, dtype=torch.int32, device=device)
        self.register_buffer(
            "page_table", pages.view(cache.max_requests, cache.pages_per_request), persistent=False
        )
        init_random_(self, seed)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch_index: torch.Tensor,
        seq_lens: torch.Tensor,
        req_slots: torch.Tensor,
        mode: str = "decode",
    ) -> torch.Tensor:
        meta = build_step_metadata(
            positions, batch_index, seq_lens, req_slots, self.page_table,
            cache=self.cache, window=self.config.sliding_window,
            ratios=self.compressed_ratios, mode=mode,
        )
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, meta)
        return self.lm_head(self.norm(h[meta.last_rows])).float()

    @torch.no_grad()
    def reset_caches(self) -> None:
        """Zero every cache, compressor state and indexer key buffer in place (addresses kept).

        State buffers are the persistent ones; constants (page table, RoPE tables, Hadamard
        matrix) are registered non-persistent.
        """
        for module in self.modules():
            for name, buf in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    buf.zero_()


@torch.no_grad()
def init_random_(module: nn.Module, seed: int) -> None:
    """Seeded random weights: linears ``N(0, 1/fan_in)``, norm weights ``1 + N(0, 0.1)``,
    ``ape`` ``N(0, 0.5)``, ``attn_sink`` ``N(0, 1)``, embeddings ``N(0, 1)``."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "weight" and p.dim() == 2:
            std = 1.0 if name.startswith("embed") else p.shape[1] ** -0.5
            value = torch.randn(p.shape, generator=gen) * std
        elif "norm" in name:
            value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        elif leaf == "ape":
            value = 0.5 * torch.randn(p.shape, generator=gen)
        else:  # attn_sink
            value = torch.randn(p.shape, generator=gen)
        p.copy_(value.to(p.dtype))


# --------------------------------------------------------------------------------------------
# Generation: greedy, a batch of prompts of different lengths, prefill then decode steps.
# --------------------------------------------------------------------------------------------


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
