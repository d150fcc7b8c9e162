"""Input builders shared by the tests."""

from __future__ import annotations

import math

import torch

import dsv4_compile as d4
from dsv4_compile import layout


def rope_table(max_pos: int, theta: float = 10000.0) -> torch.Tensor:
    """A real interleaved ``[max_pos, 64]`` (cos, sin) table."""
    inv = theta ** (-torch.arange(0, layout.ROPE_DIM, 2, dtype=torch.float64) / layout.ROPE_DIM)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.stack([ang.cos(), ang.sin()], -1).flatten(-2).float()


def store_inputs(num_tokens: int, dtype=torch.bfloat16, index_dtype=torch.int64, max_pos: int = 4096):
    kv = (torch.randn(num_tokens, layout.HEAD_DIM) * 3).to(dtype)
    weight = (1 + 0.5 * torch.randn(layout.HEAD_DIM)).to(dtype)
    freqs = rope_table(max_pos)
    positions = torch.randint(0, max_pos, (num_tokens,), dtype=index_dtype)
    return kv, weight, freqs, positions


def filled_cache(num_pages: int, page_size: int, num_tokens: int | None = None, page_stride=None):
    """A cache with ``num_tokens`` random tokens (default: every slot) stored by the op; returns
    ``(cache, slots)``."""
    cache = d4.alloc_cache(num_pages, page_size, page_stride=page_stride)
    cap = num_pages * page_size
    n = cap if num_tokens is None else num_tokens
    slots = torch.randperm(cap)[:n]
    kv, w, freqs, pos = store_inputs(n)
    d4.fused_k_norm_rope_flashmla(kv, w, freqs, pos, slots, cache, 1e-6, page_size)
    return cache, slots


def random_indices(shape, cap: int, hole_frac: float = 0.2) -> torch.Tensor:
    idx = torch.randint(0, cap, shape, dtype=torch.int32)
    return torch.where(torch.rand(shape) < hole_frac, torch.full_like(idx, -1), idx)


def sink(kind: str, heads: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "random":
        return torch.randn(heads)
    value = {"+inf": math.inf, "-inf": -math.inf}[kind]
    return torch.full((heads,), value)
