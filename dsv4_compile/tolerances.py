"""Accuracy tolerances, in one place, each with its justification.

The ops' comparisons in the tests:

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

The models' comparisons (logits, layer outputs) between two computations that legitimately round
differently fall in three kinds, each bounded in the units of its cause: one eager computation
with its sums reordered (:data:`REORDERED_ULPS`, bf16 ulps of the largest magnitude), or with its
tokens regrouped into other steps (:data:`REGROUPED_ULPS`), and computations that round at other
places (:data:`FP8_STEP_SHARE`, the FP8 step of a cached value as a share of the largest
magnitude). Token choices compared next to logits within a tolerance ``atol`` may differ
only where two logits lie within ``2 * atol`` of each other (a near-tie). Bit for bit only where
bit identity is promised (the same computation run twice, a sharded weight, a compiled graph whose
own code is exact around opaque ops).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


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
#: worst: 0.03 of it, benchmarks/RESULTS.md, "Indexer logits").
INDEXER_ULPS_PER_TERM = 1.0

#: The indexer's logits where fp8 keys and queries are multiplied on the tensor cores as e4m3
#: (``dsv4::indexer_cache_topk``'s tile kernel on NVIDIA GPUs of compute capability 8.9 or later):
#: the products are exact, but the MMA adds them with a narrower accumulator than float32 (Hopper's
#: keeps ~13 significand bits: each of its 4 steps of 32 products truncates up to 33 addends below
#: ``2^-13`` of the largest addend, which is at most the sum of the magnitudes so far). The bound is
#: ``INDEXER_FP8_MMA * sum_h |w_h| sum_d |q_hd k_d|`` (the float32 head sum's error is far inside).
INDEXER_FP8_MMA = 4 * 33 * 2**-13

#: Logits or layer outputs of one eager bf16 computation with its sums in another order: the same
#: rows in the same steps, compiled with eager's roundings (Inductor's ``emulate_precision_casts``)
#: or on another CPU or thread count (other vector widths and thread splits). A differing order
#: flips a bf16 rounding by one ulp here and there; the final hidden states then agree within a
#: couple of ulps of their scale, which moves a logit by a fraction of an ulp of the logits' scale,
#: and each side rounds its logits to bf16 (half an ulp each): within ``REORDERED_ULPS`` bf16 ulps
#: of the largest magnitude (:func:`reordered_atol`; measured: benchmarks/RESULTS.md, "Test
#: tolerances").
REORDERED_ULPS = 2

#: The same tokens in other steps: a prompt in one step, in chunks, or token by token. On top of the
#: reordering above (GEMMs of other row counts sum in other orders), the keys each step stores can
#: differ by such a flip, and a flipped key value may land on the other side of a rounding boundary
#: of its FP8 cache: one element off by an FP8 step, weighted by that key's attention probability.
#: That doubles the reordering's bound: ``REGROUPED_ULPS`` bf16 ulps of the largest magnitude
#: (:func:`regrouped_atol`).
REGROUPED_ULPS = 2 * REORDERED_ULPS

#: Logits of two computations that round at other places: compiled code that keeps a value in
#: float32 where eager code rounds it to bf16, tensor-parallel ranks that round their partial sums
#: before the all-reduce. A value that then lands on the other side of a rounding boundary of an
#: FP8 cache moves by one FP8 step, ``2**-3`` of its binade (e4m3 has 3 mantissa bits); the
#: attention output, and the logits after it, move by up to that share of their scale. Compared in
#: :func:`rerounded_atol`.
FP8_STEP_SHARE = 2**-3


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 values at magnitude ``x`` (> 0; 0 gives 0)."""
    return 0.0 if x == 0 else torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(x))


def reordered_atol(want: torch.Tensor) -> float:
    """The absolute tolerance of a reordered computation against ``want`` (:data:`REORDERED_ULPS`)."""
    return REORDERED_ULPS * bf16_ulp(want.abs().max().item())


def regrouped_atol(want: torch.Tensor) -> float:
    """The absolute tolerance of a regrouped computation against ``want`` (:data:`REGROUPED_ULPS`)."""
    return REGROUPED_ULPS * bf16_ulp(want.abs().max().item())


def rerounded_atol(want: torch.Tensor) -> float:
    """The absolute tolerance of a computation that rounds at other places (:data:`FP8_STEP_SHARE`)."""
    return FP8_STEP_SHARE * want.abs().max().item()
