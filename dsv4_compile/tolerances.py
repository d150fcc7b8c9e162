"""Accuracy tolerances, in one place, each with its justification.

Two comparisons are made in the tests:

* ``REFERENCE``: the reference kernels against an independent float64 computation. The reference
  does fp32 math and rounds the output once to bf16, so ``out`` is within half a bf16 ulp
  (``2**-9`` relative) of the fp32 result plus fp32 accumulation error; ``lse`` and ``max_logits``
  carry only fp32 accumulation error (dot products of 512 terms, sums of up to a few thousand).
* ``DEVICE``: a device kernel against the reference on the same inputs. Keys dequantize exactly
  to bf16 (an fp8 value times a power of two), so ``q.K`` is exact up to fp32 accumulation order;
  but FlashMLA-style kernels round the softmax weights to bf16 before the ``P.V`` product, which
  adds up to ``2**-9`` relative error per weight: bounded by ``2**-8 * max|V|`` on ``out``.
  Statistics stay fp32 (accumulation order only).

Tolerances are ``(atol, rtol)`` for ``torch.testing.assert_close``; ``out`` tolerances are scaled
by the largest key magnitude of the case (``atol * max|V|``), since ``out`` is a convex
combination of keys.
"""

from __future__ import annotations

from typing import NamedTuple


class Tolerance(NamedTuple):
    atol: float
    rtol: float


REFERENCE = {
    "out": Tolerance(atol=2**-8, rtol=2**-8),  # relative to max|V|; one bf16 rounding
    "lse": Tolerance(atol=1e-4, rtol=1e-5),  # fp32 accumulation
    "max_logits": Tolerance(atol=1e-4, rtol=1e-5),  # fp32 dot products
}

DEVICE = {
    "out": Tolerance(atol=2**-7, rtol=2**-7),  # relative to max|V|; bf16 P before P.V + bf16 out
    "lse": Tolerance(atol=1e-3, rtol=1e-4),  # fp32, different accumulation order / exp2 math
    "max_logits": Tolerance(atol=1e-3, rtol=1e-4),
}

#: The cache store: dequantized values of a device kernel against the reference's. fp8 codes may
#: differ by one step where the fp32 value lands on (or within an ulp of) a rounding tie; a
#: differing byte is one fp8 step: 2**-3 relative (e4m3 has 3 mantissa bits).
STORE_FP8_STEP = 2**-3

#: The indexer's logits (``dsv4::indexer_logits``), each provider against a float64 sum: the error
#: bound is ``INDEXER_ULPS_PER_TERM * (D + H) * eps32 * sum_h |w_h| sum_d |q_hd k_d|``. A float32
#: dot product of ``D`` terms errs by at most ``~D * eps32`` of the sum of its terms' magnitudes,
#: and the weighted sum over ``H`` heads adds ``~H * eps32``; 3xTF32 products (NVIDIA) represent
#: each operand with ~21 significand bits, a few eps32 per product, inside the same bound (measured
#: worst: 0.03 of it, benchmarks/RESULTS.md).
INDEXER_ULPS_PER_TERM = 1.0
