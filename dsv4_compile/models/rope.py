"""Interleaved (GPT-J) rotary embedding with DSV4's YaRN frequency blend, as plain PyTorch.

DSV4 rotates the last 64 dims of a vector in pairs ``(x[2i], x[2i+1])`` by the angle
``pos * f_i``. A layer's frequencies depend on its kind (upstream: SGLang
``python/sglang/srt/models/deepseek_v4.py`` ``MQALayer.__init__`` and
``python/sglang/srt/layers/deepseek_v4_rope.py`` ``precompute_freqs_cis``, revision 130a4070):

* ``compress_ratio == 0``: ``f_i = rope_theta ** (-2i/64)``, no YaRN;
* ``compress_ratio in (4, 128)``: base ``compress_rope_theta`` and the YaRN blend
  ``f_i' = f_i / factor * (1 - s_i) + f_i * s_i``, where the smooth weight ``s_i`` is 1 for the
  fast-rotating dims, 0 for the slow ones, a linear ramp between the correction dims of
  ``beta_fast`` and ``beta_slow`` rotations over ``original_max_position_embeddings``. No
  attention-scale (mscale) factor is applied to cos/sin.

Angles are computed in float32 as upstream does (``outer(arange(max_pos), f)``), so the table
matches upstream's bit for bit. The table is the real ``[max_pos, 64]`` float32
``(cos_0, sin_0, cos_1, sin_1, ...)`` that ``dsv4::fused_k_norm_rope_flashmla`` takes as ``freqs``.
"""

from __future__ import annotations

import functools
import math

import torch

from .. import layout
from ..providers import reference
from .config import DeepseekV4Config


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The dim index whose frequency makes ``rotations`` full turns over ``max_pos`` positions."""
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inv_freq(
    dim: int,
    base: float,
    *,
    factor: float = 1.0,
    original_max_pos: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """The ``dim / 2`` rotation frequencies (float32); YaRN-blended when ``original_max_pos > 0``."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_max_pos > 0:
        low = max(math.floor(_correction_dim(beta_fast, dim, base, original_max_pos)), 0)
        high = min(math.ceil(_correction_dim(beta_slow, dim, base, original_max_pos)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp  # 1: keep the frequency (fast dims), 0: divide by factor (slow dims)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_table(max_pos: int, freqs: torch.Tensor) -> torch.Tensor:
    """The real interleaved ``[max_pos, 2 * len(freqs)]`` float32 table ``(cos_i, sin_i)`` per row."""
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).flatten(-2)


@functools.lru_cache(maxsize=8)
def _layer_table(config: DeepseekV4Config, compressed: bool, device: str) -> torch.Tensor:
    if compressed:
        freqs = inv_freq(
            config.qk_rope_head_dim,
            config.compress_rope_theta,
            factor=config.rope_factor,
            original_max_pos=config.original_max_position_embeddings,
            beta_fast=config.beta_fast,
            beta_slow=config.beta_slow,
        )
    else:
        freqs = inv_freq(config.qk_rope_head_dim, config.rope_theta)
    return rope_table(config.max_position_embeddings, freqs).to(device)


def layer_rope_table(
    config: DeepseekV4Config, compress_ratio: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The ``[max_position_embeddings, 64]`` table of a layer of kind ``compress_ratio``.

    Built once per (config, kind, device) and shared: every layer of a kind gets the same tensor.
    """
    return _layer_table(config, compress_ratio > 0, str(torch.device(device or "cpu")))


def apply_rope(
    x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate ``x [T, ..., 2n]`` (pairs ``(x[2i], x[2i+1])``) by ``table[positions]``, in float32.

    Forward: ``(a, b) -> (a c - b s, a s + b c)``; inverse (the conjugate rotation):
    ``(a, b) -> (a c + b s, b c - a s)``. Returns float32 of ``x``'s shape. The arithmetic of the
    ``dsv4`` ops' reference (:func:`dsv4_compile.providers.reference.rope`), so the model's
    rotations and the ops' agree bit for bit.
    """
    return reference.rope(x, table, positions, inverse)


def rope_last(
    x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False,
    dtype: torch.dtype = torch.float32, in_place: bool = False,
) -> torch.Tensor:
    """``x`` with its last ``ROPE_DIM`` dims rotated in float32 and the leading dims passed through,
    as ``dtype`` (float32 by default; else the float32 result rounded once).

    Under ``torch.compile`` / ``torch.export``: :func:`rope_full_width`, which Inductor fuses into
    the kernels around it. Eagerly: a ``dtype`` copy of ``x`` with its last dims rotated in place
    by :func:`apply_rope`, the same bits in one full-width tensor instead of the full-width form's
    five float32 ones (they were an eager prefill step's peak). ``in_place``: ``x`` (already
    ``dtype``) is a temporary the caller gives up, so eagerly it is rotated and returned without
    that copy (compiled, the result is a new tensor as always: use the return value).
    """
    if torch.compiler.is_compiling():
        return rope_full_width(x, table, positions, inverse=inverse).to(dtype)
    out = x if in_place and x.dtype == dtype else x.to(dtype, copy=True)
    out[..., -layout.ROPE_DIM:] = apply_rope(x[..., -layout.ROPE_DIM:], table, positions, inverse=inverse)
    return out


def rope_full_width(
    x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """:func:`rope_last`'s float32 result, written over the full width for Inductor.

    The same arithmetic as :func:`apply_rope` on the last dims (bit for bit, eagerly):
    ``where(rope dim, x * cos + partner * sin, x)``, where ``partner`` is the other element of the
    dim's pair (``x[d ^ 1]``) and ``sin`` carries the pair member's sign. Every term is elementwise
    over ``x``'s shape (no slicing and concatenation), so Inductor fuses the rotation into the
    kernel that produces ``x`` (e.g. the query's RMSNorm) and its consumer.
    """
    x = x.float()
    width, half = x.shape[-1], layout.ROPE_DIM // 2
    cs = table[positions].view(positions.shape[0], *([1] * (x.dim() - 2)), half, 2)
    cos, sin = cs[..., :1], cs[..., 1:]
    # pair (a, b): a' = a c - b s = a c + b (-s); b' = b c + a s (inverse: s -> -s)
    signed = torch.cat([sin, -sin] if inverse else [-sin, sin], dim=-1)
    pad = (width - layout.ROPE_DIM, 0)
    cos = torch.nn.functional.pad(cos.expand(cs.shape).flatten(-2), pad)
    signed = torch.nn.functional.pad(signed.flatten(-2), pad)
    partner = x.unflatten(-1, (width // 2, 2)).flip(-1).flatten(-2)
    rope = torch.arange(width, device=x.device) >= width - layout.ROPE_DIM
    return torch.where(rope, x * cos + partner * signed, x)
