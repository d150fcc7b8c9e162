"""An independent bit-level model of the V4.1 KV-cache formats (FP8 528 B/token, FP4 288 B/token).

Written from the format contract only: nothing here imports dsv4_compile. Roundings are exact
(Fractions, bisection on the finite code tables), so the model is a test oracle, not an approximation.
``torch`` is used only to move uint8 bytes in and out of a cache tensor.

A token with a non-finite value (NaN or +-inf) is the NaN token (docs/design.md §2.5): FP8 data
0x7F (e4m3 NaN) and scales 0xFF (UE8M0 NaN); FP4 data 0x00 and scales 0x7F (e4m3 NaN). Every
value of it decodes to NaN.
"""

from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction

import torch

D, NOPE, ROPE = 512, 448, 64
FP8_BLOCK, FP4_BLOCK = 32, 16
_LAYOUT = {"fp8": (512, 16, 512), "fp4": (256, 32, 256)}  # data bytes, scale bytes, block-split pad


# ---- scalar roundings ----


def _round_binary(q: Fraction, precision: int, emin: int, emax: int) -> float:
    """Nearest (ties to even) binary float with ``precision`` significand bits and exponents emin..emax."""
    if q == 0:
        return 0.0
    sign, q = (-1.0 if q < 0 else 1.0), abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()  # 2^(e-1) <= q < 2^(e+1)
    if q < Fraction(2) ** e:
        e -= 1
    quantum = Fraction(2) ** (max(e, emin) - precision + 1)
    n = round(q / quantum)  # Fraction.__round__ is round-half-even
    value = n * quantum
    return sign * (math.inf if value >= Fraction(2) ** (emax + 1) else float(value))


def fp32(value: float) -> float:
    """float32(value), round to nearest even (struct does the C float cast); overflow gives +-inf."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def fp32_div(a: float, b: float) -> float:
    """IEEE float32 a / b: the exact quotient rounded once to float32 (no double rounding)."""
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return fp32(a / b) if b != 0 else math.nan
    return _round_binary(Fraction(a) / Fraction(b), 24, -126, 127)


def bf16(value: float) -> float:
    """bfloat16(value), round to nearest even directly from float64 (8-bit significand, fp32 range)."""
    if not math.isfinite(value):
        return value
    return _round_binary(Fraction(value), 8, -126, 127)


# ---- fp8 e4m3fn (1 sign, 4 exponent bits bias 7, 3 mantissa bits; no inf; 0x7F/0xFF NaN) ----


def fp8_e4m3_decode(byte: int) -> float:
    """(-1)^s * (1 + m/8) * 2^(e-7); subnormal (e = 0): m/8 * 2^-6; e = 15, m = 7: NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def _rne_table(value: float, table: list[float]) -> int:
    """Index of the nearest entry of an ascending magnitude table; ties to the even index; saturating."""
    mag = abs(value)
    if mag >= table[-1]:
        return len(table) - 1
    hi = bisect.bisect_left(table, mag)
    if table[hi] == mag:
        return hi
    lo = hi - 1
    mid = (Fraction(table[lo]) + Fraction(table[hi])) / 2
    if Fraction(mag) != mid:
        return lo if Fraction(mag) < mid else hi
    return lo if lo % 2 == 0 else hi


_E4M3 = [fp8_e4m3_decode(b) for b in range(0x7F)]  # 0 .. 448 ascending; index == code


def fp8_e4m3_encode_rne(value: float) -> int:
    """Nearest e4m3fn code, ties to even mantissa, saturating at +-448, sign kept on zero; NaN -> 0x7F."""
    if math.isnan(value):
        return 0x7F
    return (0x80 if math.copysign(1.0, value) < 0 else 0) | _rne_table(value, _E4M3)


# ---- e2m1 (1 sign, 2 exponent bits bias 1, 1 mantissa bit) ----

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_decode(code: int) -> float:
    """Magnitude table [0, .5, 1, 1.5, 2, 3, 4, 6][code & 7], negated when bit 3 is set."""
    return (-1.0 if code & 0x8 else 1.0) * _E2M1[code & 0x7]


def e2m1_encode(value: float) -> int:
    """Nearest e2m1 code, ties to even (mantissa bit 0), saturating at +-6, sign kept on zero."""
    return (0x8 if math.copysign(1.0, value) < 0 else 0) | _rne_table(value, _E2M1)


# ---- one token ----


def _poisoned(values: list[float]) -> bool:
    return any(not math.isfinite(v) for v in values)


_FP32_1E4 = fp32(1e-4)


def _ue8m0_scale(amax: float) -> int:
    """Biased exponent of 2^ceil(log2(max(fp32(amax / 448), fp32(1e-4)))), read from the float32 bits."""
    q = max(fp32_div(amax, 448.0), _FP32_1E4)
    bits = struct.unpack("<I", struct.pack("<f", q))[0]
    return ((bits >> 23) & 0xFF) + (1 if bits & 0x7FFFFF else 0)


def v41_fp8_token(values: list[float]) -> tuple[list[int], list[int]]:
    """512 e4m3 bytes RNE(x / 2^(s-127)) and 16 UE8M0 bytes s, one per 32 values (see _ue8m0_scale)."""
    assert len(values) == D
    if _poisoned(values):
        return [0x7F] * D, [0xFF] * (D // FP8_BLOCK)
    data, scales = [], []
    for b in range(0, D, FP8_BLOCK):
        block = values[b : b + FP8_BLOCK]
        s = _ue8m0_scale(max(abs(v) for v in block))
        data += [fp8_e4m3_encode_rne(v / 2.0 ** (s - 127)) for v in block]  # exact power-of-two division
        scales.append(s)
    return data, scales


def v41_fp4_token(values: list[float]) -> tuple[list[int], list[int]]:
    """256 bytes of e2m1 pairs (even index in the low nibble) and 32 e4m3 scales, one per 16 values.

    scale = e4m3_rne(clamp(fp32(amax / 6), 2^-9, 448)); code = e2m1(fp32(fp32(x) / scale)).
    """
    assert len(values) == D
    if _poisoned([fp32(v) for v in values]):
        return [0x00] * (D // 2), [0x7F] * (D // FP4_BLOCK)
    codes, scales = [], []
    for b in range(0, D, FP4_BLOCK):
        block = [fp32(v) for v in values[b : b + FP4_BLOCK]]
        s = fp8_e4m3_encode_rne(min(max(fp32_div(max(abs(v) for v in block), 6.0), 2.0**-9), 448.0))
        scale = fp8_e4m3_decode(s)
        codes += [e2m1_encode(fp32_div(v, scale)) for v in block]
        scales.append(s)
    return [codes[i] | codes[i + 1] << 4 for i in range(0, D, 2)], scales


def v41_fp8_decode_token(data: list[int], scales: list[int]) -> list[float]:
    """x_i = e4m3(data_i) * 2^(scales[i // 32] - 127); scale byte 0xFF is NaN."""
    return [fp8_e4m3_decode(data[i]) * (math.nan if scales[i // FP8_BLOCK] == 0xFF else
                                          2.0 ** (scales[i // FP8_BLOCK] - 127)) for i in range(D)]


def v41_fp4_decode_token(data: list[int], scales: list[int]) -> list[float]:
    """x_i = e2m1(nibble i) * e4m3(scales[i // 16]); nibble 2j is the low half of byte j."""
    return [e2m1_decode(data[i // 2] >> (4 * (i % 2)) & 0xF) * fp8_e4m3_decode(scales[i // FP4_BLOCK])
            for i in range(D)]


# ---- page layout ----


def canonical_page_stride(fmt: str, arrangement: str, page_size: int) -> int:
    """Block-split: P*(data+scales) rounded up to 512 (fp8) / 256 (fp4); interleaved: P*528 / P*288."""
    nd, ns, pad = _LAYOUT[fmt]
    size = page_size * (nd + ns)
    if arrangement == "interleaved":
        return size
    assert arrangement == "block"
    return -(-size // pad) * pad


def record_offsets(fmt: str, arrangement: str, page_size: int, offset: int) -> tuple[int, int]:
    """Byte offsets in the page of token ``offset``'s data and scales."""
    nd, ns, _ = _LAYOUT[fmt]
    assert 0 <= offset < page_size
    if arrangement == "interleaved":
        return offset * (nd + ns), offset * (nd + ns) + nd
    assert arrangement == "block"
    return offset * nd, page_size * nd + offset * ns


def _locate(cache: torch.Tensor, fmt: str, arrangement: str, page_size: int, slot: int):
    nd, ns, _ = _LAYOUT[fmt]
    assert cache.dtype == torch.uint8 and cache.dim() == 2
    page, offset = divmod(slot, page_size)
    assert 0 <= page < cache.shape[0], f"slot {slot} outside {cache.shape[0]} pages"
    d0, s0 = record_offsets(fmt, arrangement, page_size, offset)
    assert max(d0 + nd, s0 + ns) <= cache.shape[1], "page stride too small for this layout"
    return page, d0, s0, nd, ns


def write_token(cache: torch.Tensor, fmt: str, arrangement: str, page_size: int, slot: int,
                data: list[int], scales: list[int]) -> None:
    """Store one token's data and scale bytes at ``slot`` = page * P + offset of cache [pages, stride]."""
    page, d0, s0, nd, ns = _locate(cache, fmt, arrangement, page_size, slot)
    assert len(data) == nd and len(scales) == ns
    cache[page, d0 : d0 + nd] = torch.tensor(data, dtype=torch.uint8)
    cache[page, s0 : s0 + ns] = torch.tensor(scales, dtype=torch.uint8)


def read_token(cache: torch.Tensor, fmt: str, arrangement: str, page_size: int,
               slot: int) -> tuple[list[int], list[int]]:
    """The (data, scales) bytes of the token at ``slot``."""
    page, d0, s0, nd, ns = _locate(cache, fmt, arrangement, page_size, slot)
    row = cache[page]
    return row[d0 : d0 + nd].tolist(), row[s0 : s0 + ns].tolist()


# ---- the fused V4.1 K store ----


def v41_fused_k_token(x: list[float], w: list[float], cs: list[float], eps: float,
                      fp4: bool = False) -> tuple[list[int], list[int], list[float]]:
    """y = bf16(x / sqrt(mean(x^2) + eps) * w) in float64; dims 448.. get interleaved RoPE
    (a, b) -> (a c - b s, a s + b c), (c, s) = cs[2i], cs[2i+1], then bf16 again; then quantize y
    (FP8, or ``fp4``).
    Returns (data, scales, y as the bf16 values that were quantized)."""
    assert len(x) == D and len(w) == D and len(cs) == ROPE
    rms = math.sqrt(sum(v * v for v in x) / D + eps)
    y = [bf16(x[i] / rms * w[i]) for i in range(D)]
    for i in range(ROPE // 2):
        a, b = y[NOPE + 2 * i], y[NOPE + 2 * i + 1]
        c, s = cs[2 * i], cs[2 * i + 1]
        y[NOPE + 2 * i], y[NOPE + 2 * i + 1] = bf16(a * c - b * s), bf16(a * s + b * c)
    data, scales = (v41_fp4_token if fp4 else v41_fp8_token)(y)
    return data, scales, y
