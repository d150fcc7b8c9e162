"""An independent float64 model of the dsv4 ops, written straight from docs/design.md §2.

Nothing here calls dsv4_compile's kernels or layout helpers: the fp8 e4m3 codec, the UE8M0 scale,
the byte offsets and the attention math are re-derived with plain Python/NumPy-style loops, so the
reference is tested against the contract, not against itself.
"""

from __future__ import annotations

import math

import torch

D, NOPE, ROPE, TILE = 512, 448, 64, 64


# ---- fp8 e4m3fn codec (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no inf; 0x7f NaN) ----


def fp8_decode(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


_POSITIVE = [(fp8_decode(b), b) for b in range(0x7F)]  # 0 .. 448, ascending


def fp8_encode(value: float) -> int:
    """Round-to-nearest-even onto e4m3fn, saturating at +-448."""
    sign = 0x80 if value < 0 or (value == 0 and math.copysign(1, value) < 0) else 0
    mag = min(abs(value), 448.0)
    best = min(_POSITIVE, key=lambda vb: (abs(vb[0] - mag), vb[1] & 1))  # ties -> even code
    return sign | best[1]


def bf16_bytes(value: float) -> bytes:
    return torch.tensor([value], dtype=torch.float64).to(torch.bfloat16).view(torch.uint8).tolist()


# ---- the store ----


def store_token(x: list[float], w: list[float], cs: list[float], eps: float) -> tuple[list[int], list[int], list[float]]:
    """One token's 576 data bytes, 8 scale bytes, and its exact float64 values (for tolerance checks)."""
    rms = math.sqrt(sum(v * v for v in x) / D + eps)
    y = [x[i] / rms * w[i] for i in range(D)]
    for i in range(ROPE // 2):
        a, b = y[NOPE + 2 * i], y[NOPE + 2 * i + 1]
        c, s = cs[2 * i], cs[2 * i + 1]
        y[NOPE + 2 * i], y[NOPE + 2 * i + 1] = a * c - b * s, a * s + b * c
    data, scales = [], []
    for t in range(NOPE // TILE):
        tile = y[t * TILE : (t + 1) * TILE]
        scale = max(1e-4, max(abs(v) for v in tile)) / 448
        m, e = math.frexp(scale)  # scale = m * 2**e, 0.5 <= m < 1
        e = e - 1 if m == 0.5 else e  # ceil(log2(scale))
        data += [fp8_encode(v / 2.0**e) for v in tile]
        scales.append(e + 127)
    for v in y[NOPE:]:
        data += bf16_bytes(v)
    return data, scales + [0], y


def decode_cache_token(cache: torch.Tensor, page_size: int, slot: int) -> list[float]:
    """The 512 values of the token at ``slot``, decoded from raw bytes by the layout in docs/design.md §2.2."""
    page, off = divmod(slot, page_size)
    row = cache[page].tolist()
    data = row[off * 576 : off * 576 + 576]
    exps = row[page_size * 576 + off * 8 : page_size * 576 + off * 8 + 7]
    values = [fp8_decode(data[i]) * 2.0 ** (exps[i // TILE] - 127) for i in range(NOPE)]
    rope = torch.tensor(data[NOPE:], dtype=torch.uint8).view(torch.bfloat16).double().tolist()
    return values + rope


# ---- attention ----


def attend(q: torch.Tensor, keys: torch.Tensor, scale: float, sink: torch.Tensor | None):
    """float64 attention of ``q [H, d]`` over ``keys [n, d]`` (V = K) with an optional sink [H].

    Returns ``out [H, d]``, ``lse [H]`` (sink excluded), ``max_logit [H]``; an empty key set gives
    ``(0, +inf, -inf)``. ``out = sum_j e^{s_j} K_j / (sum_j e^{s_j} + e^{sink})``.
    """
    q, keys = q.double(), keys.double()
    heads = q.shape[0]
    if keys.shape[0] == 0:
        return (torch.zeros(heads, keys.shape[1], dtype=torch.float64),
                torch.full((heads,), math.inf, dtype=torch.float64),
                torch.full((heads,), -math.inf, dtype=torch.float64))
    s = scale * (q @ keys.T)  # [H, n]
    m = s.max(-1).values
    e = torch.exp(s - m[:, None])
    z = e.sum(-1)
    sink_term = torch.zeros(heads, dtype=torch.float64) if sink is None else torch.exp(sink.double() - m)
    out = (e @ keys) / (z + sink_term)[:, None]  # sink = +inf -> division by inf -> 0
    return out, m + torch.log(z), m
