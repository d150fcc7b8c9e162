"""Input builders shared by the tests."""

from __future__ import annotations

import gc
import math
import re

import pytest
import torch

import dsv4_compile as d4
from dsv4_compile import layout
from dsv4_compile.ops import registry


def rope_table(max_pos: int, theta: float = 10000.0) -> torch.Tensor:
    """A real interleaved ``[max_pos, 64]`` (cos, sin) table."""
    inv = theta ** (-torch.arange(0, layout.ROPE_DIM, 2, dtype=torch.float64) / layout.ROPE_DIM)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.stack([ang.cos(), ang.sin()], -1).flatten(-2).float()


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The normalised ``n x n`` Sylvester Hadamard matrix, float64, built by Kronecker products
    (independent of ``layout.hadamard``'s butterflies): ``H[i, j] = (-1)^popcount(i & j) / sqrt(n)``."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h / math.sqrt(n)


def store_inputs(num_tokens: int, dtype=torch.bfloat16, index_dtype=torch.int64, max_pos: int = 4096):
    kv = (torch.randn(num_tokens, layout.HEAD_DIM) * 3).to(dtype)
    weight = (1 + 0.5 * torch.randn(layout.HEAD_DIM)).to(dtype)
    freqs = rope_table(max_pos)
    positions = torch.randint(0, max_pos, (num_tokens,), dtype=index_dtype)
    return kv, weight, freqs, positions


def filled_cache(num_pages: int, page_size: int, num_tokens: int | None = None, page_stride=None,
                 kv_format: str = "v4"):
    """A cache with ``num_tokens`` random tokens (default: every slot) stored by the op; returns
    ``(cache, slots)``."""
    cache = d4.alloc_cache(num_pages, page_size, page_stride=page_stride, kv_format=kv_format)
    cap = num_pages * page_size
    n = cap if num_tokens is None else num_tokens
    slots = torch.randperm(cap)[:n]
    kv, w, freqs, pos = store_inputs(n)
    d4.fused_k_norm_rope_flashmla(kv, w, freqs, pos, slots, cache, 1e-6, page_size, kv_format)
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


def _live_storages() -> set[int]:
    gc.collect()
    return {t.untyped_storage().data_ptr() for t in gc.get_objects()
            if type(t) is torch.Tensor and t.untyped_storage().nbytes()}


def assert_calls_keep_no_new_tensor(calls, forget=lambda: None) -> None:
    """``calls()`` (returning its outputs, an iterable of tensors) leaves no tensor it allocated
    alive but its outputs, once ``forget()`` has dropped what the test's stand-ins recorded. An
    adapter that kept a tensor from its first call (a dummy buffer, a stored error's frames) would,
    when that call ran inside a ``reduce-overhead`` warm-up, keep it in the CUDA-graph pool, and
    the graph would refuse to record. Views of tensors that existed before are allowed (they
    allocate nothing)."""
    before = _live_storages()
    outputs = {t.untyped_storage().data_ptr() for t in calls()}
    forget()
    assert _live_storages() - before - outputs == set()


def report(config, line: str) -> None:
    """Write ``line`` to the terminal past pytest's output capture."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    with config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        reporter.write("\n")
        reporter.write_line(line)


def patch_triton_interpreter() -> None:
    """Work around two Triton 3.6 interpreter bugs the kernels hit, nothing else (call in a
    ``TRITON_INTERPRET=1`` process before the first launch): a scalar loop bound is a 1-element
    array that NumPy >= 2.4 refuses to ``int()`` (triton-lang/triton#9171), and ``tl.dot`` on
    bfloat16 operands multiplies their bit patterns (the interpreter has no bf16 arithmetic,
    triton-lang/triton#11584); the shim converts them to float32 first, exactly."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it

    patch_tensor = it._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    dot = it.InterpreterBuilder.create_dot

    def as_float32(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return it.TensorHandle(it._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)

    it._patch_lang_tensor = patched_tensor
    it.InterpreterBuilder.create_dot = lambda self, a, b, *rest: dot(self, as_float32(a), as_float32(b), *rest)


def run_interpreted_child(config, test_file: str, echo: tuple[str, ...] = ()) -> None:
    """Run ``test_file``'s CPU tests in a child pytest with ``TRITON_INTERPRET=1`` (Triton reads it
    when kernels are jitted, which this process may have done already); skipped without Triton or
    NumPy. Fails unless the child
    passes and ran at least one test; echoes its summary and the lines starting with ``echo``."""
    import os
    import re
    import subprocess
    import sys

    import pytest

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process is interpreted already: the interpreted tests run here")
    pytest.importorskip("triton")
    pytest.importorskip("numpy")  # the interpreter's arrays
    test_file = os.path.abspath(test_file)
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
         "-k", "not test_interpreted_suite", test_file],
        cwd=os.path.dirname(os.path.dirname(test_file)), env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    passed = re.search(r"(\d+) passed", child.stdout)
    assert passed and int(passed[1]) > 0, "the interpreted child ran no test:\n" + child.stdout[-3000:]
    for line in child.stdout.splitlines():
        if line.startswith(echo) or passed[0] in line:
            report(config, f"TRITON_INTERPRET=1 child: {line}")


# --------------------------------------------------------------------------------------------
# Garbage where a row does not look: no output may depend on bytes its row does not reference
# --------------------------------------------------------------------------------------------

#: Bytes real engines leave in padding pages: 0x7F (fp8 NaN, bf16 3.4e38 pairs) and 0xFF (fp8 NaN,
#: bf16 NaN, UE8M0 255 -> 2^128 = inf).
GARBAGE_BYTES = (0x7F, 0xFF)


def referenced_slots(indices: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """The slots the counted entries of ``indices [B, s_q, K]`` reference (not ``-1``, ``j < lengths[b]``)."""
    counted = indices >= 0
    if lengths is not None:
        counted &= torch.arange(indices.shape[-1], device=indices.device) < lengths[:, None, None]
    return indices[counted].unique()


def poison_unreferenced(cache: torch.Tensor, page_size: int, slots: torch.Tensor, byte: int,
                        kv_format: str = "v4") -> torch.Tensor:
    """A copy of ``cache`` with every byte set to ``byte`` except the data and scale records of each
    slot ``p*P + o`` in ``slots`` (the format's geometry, checked against the models in
    test_layout.py and test_formats.py)."""
    fmt = d4.layout.FORMATS[kv_format]
    poisoned = torch.full_like(cache, byte)
    for s in slots.tolist():
        p, o = divmod(s, page_size)
        for start, size in ((fmt.data_offset(page_size, o), fmt.data_bytes),
                            (fmt.scale_offset(page_size, o), fmt.scale_bytes)):
            poisoned[p, start : start + size] = cache[p, start : start + size]
    return poisoned


def decode_args_around_garbage(heads: int = 16, s_q: int = 2, device="cpu", width: int = 24,
                               kv_format: str = "v4", extra_format: str | None = None) -> list:
    """Decode arguments (schema order) whose counted entries avoid page 0 of both caches, while
    entries past ``topk_length`` point into it (slot 0) and ``-1`` holes sit among the counted ones."""
    batch, page_size, extra_page_size, extra_width = 3, 16, 2, 6
    cache, _ = filled_cache(4, page_size, kv_format=kv_format)
    extra, _ = filled_cache(4, extra_page_size, kv_format=extra_format or kv_format)
    indices = random_indices((batch, s_q, width), 3 * page_size) + page_size  # pages 1..3
    indices[indices == page_size - 1] = -1
    lengths = torch.tensor([width, 10, 0], dtype=torch.int32)
    extra_indices = random_indices((batch, s_q, extra_width), 3 * extra_page_size) + extra_page_size
    extra_indices[extra_indices == extra_page_size - 1] = -1
    extra_lengths = torch.tensor([3, 0, extra_width], dtype=torch.int32)
    for idx, ln in ((indices, lengths), (extra_indices, extra_lengths)):
        for b, n in enumerate(ln.tolist()):
            idx[b, :, n:] = 0  # uncounted: read nothing, whatever slot 0 holds
    q = torch.randn(batch, s_q, heads, 512, dtype=torch.bfloat16)
    sink_vals = torch.randn(heads)
    args = [q, cache, page_size, indices, lengths, sink_vals, extra, extra_page_size, extra_indices,
            extra_lengths, None, None, 512**-0.5, 512, kv_format, extra_format]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def poisoned_decode_args(args: list, byte: int) -> list:
    """``args`` (from :func:`decode_args_around_garbage`) with every unreferenced cache byte ``byte``."""
    args = list(args)
    formats = (args[14], args[15] or args[14]) if len(args) > 14 else ("v4", "v4")
    for (cache_at, size_at, idx_at, len_at), fmt in zip(((1, 2, 3, 4), (6, 7, 8, 9)), formats):
        slots = referenced_slots(args[idx_at].cpu(), args[len_at].cpu())
        poisoned = poison_unreferenced(args[cache_at].cpu(), args[size_at], slots, byte, fmt)
        args[cache_at] = poisoned.to(args[cache_at].device)
    return args


def prefill_args_around_garbage(heads: int = 16, device="cpu") -> list:
    """Prefill arguments whose counted indices avoid workspace row 0, while holes (negative,
    ``>= s_kv``) and entries past ``topk_length`` do not; see :func:`poisoned_prefill_args`."""
    s_q, s_kv, width = 5, 40, 16
    q = torch.randn(s_q, heads, 512, dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, 512, dtype=torch.bfloat16)
    indices = torch.randint(1, s_kv, (s_q, 1, width), dtype=torch.int32)
    indices[:, :, 3] = -1
    indices[:, :, 5] = -7
    indices[:, :, 7] = s_kv + 2
    lengths = torch.tensor([width, 9, 0, 12, 1], dtype=torch.int32)
    for s, n in enumerate(lengths.tolist()):
        indices[s, :, n:] = 0
    args = [q, kv, indices, 512**-0.5, 512, torch.randn(heads), lengths]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def poisoned_prefill_args(args: list, byte: int) -> list:
    """``args`` with every workspace row no counted index references filled with ``byte``."""
    args = list(args)
    kv, indices, lengths = args[1], args[2], args[6]
    counted = (indices[:, 0] >= 0) & (indices[:, 0] < kv.shape[0])
    counted &= torch.arange(indices.shape[-1], device=kv.device) < lengths[:, None]
    keep = torch.zeros(kv.shape[0], dtype=torch.bool, device=kv.device)
    keep[indices[:, 0][counted].long()] = True
    garbage = torch.full_like(kv.view(torch.uint8), byte).view(kv.dtype)
    args[1] = torch.where(keep[:, None, None], kv, garbage)
    return args


def assert_garbage_is_invisible(run, heads: int, byte: int) -> None:
    """Decode and prefill through ``run(op_name, *args)`` over memory whose unreferenced bytes are
    ``byte`` give the outputs over clean memory bit for bit (and those are finite)."""
    for op, build, poison in (("flash_mla_with_kvcache", decode_args_around_garbage, poisoned_decode_args),
                              ("flash_mla_sparse_fwd", prefill_args_around_garbage, poisoned_prefill_args)):
        args = build(heads=heads)
        clean = run(op, *args)
        dirty = run(op, *poison(args, byte))
        assert clean[0].isfinite().all(), op
        assert all(torch.equal(a, b) for a, b in zip(clean, dirty)), op


def assert_steps_close(got, want, atol_of, first_step: int = 0) -> None:
    """Each step's ``got`` within ``atol_of(want)`` of its ``want`` (``atol_of``: one of the
    ``tolerances.*_atol``, derived from the rounding the two computations may differ by), with no
    relative term; a failure names the step (counted from ``first_step``)."""
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=first_step):
        torch.testing.assert_close(g, w, atol=atol_of(w), rtol=0, msg=lambda m: f"step {step}: {m}")


def near_tie_margin(logits, atol_of) -> float:
    """How far below the top logit another run's choice may lie when both runs' logits of every
    step agree within ``atol_of`` (:func:`assert_steps_close`): each of two logits may move by that
    much, so only choices within twice the tolerance can swap."""
    return 2 * max(map(atol_of, logits))


def assert_same_choices_but_near_ties(logits, chosen, other, atol_of) -> None:
    """``other``'s greedy tokens are ``chosen``'s (the run whose ``logits`` of every step these
    are), except where ``other``'s token lies within :func:`near_tie_margin` of the top logit: a
    near-tie that two computations rounding differently (compiled vs eager, sharded vs not, chunked
    vs one step) may break either way. Compare runs fed the same tokens (``generate(...,
    follow=...)``), their logits within ``atol_of``."""
    from dsv4_compile.generation import choice_margins

    margin = near_tie_margin(logits, atol_of)
    margins = choice_margins(logits, chosen, other)
    assert max(margins, default=0.0) <= margin, f"choices differ {margins} below the top logit: {chosen} vs {other}"


#: Malformed calls of the decode and the prefill at 64 heads (the path FlashMLA serves unpadded,
#: where the ``flashmla`` provider checks the call in its kernel: ``Provider.validates``):
#: ``(op, position, bad value as a function of the device, exception, argument named)``.
MALFORMED_UNPADDED = [
    ("decode", 0, lambda d: torch.randn(2, 1, 64, 512, device=d), TypeError, "q"),
    ("decode", 0, lambda d: torch.randn(2, 1, 64, 576, dtype=torch.bfloat16, device=d), ValueError, "q"),
    ("decode", 0, lambda d: torch.randn(2, 64, 512, dtype=torch.bfloat16, device=d), ValueError, "q"),
    ("decode", 1, lambda d: d4.flashmla_view(d4.alloc_cache(4, 64, d), 64), TypeError, "k_cache"),
    ("decode", 2, lambda d: 0, ValueError, "page_size"),
    ("decode", 2, lambda d: 128, ValueError, "k_cache"),  # the page stride holds 64 tokens
    ("decode", 3, lambda d: torch.zeros(2, 1, 64, dtype=torch.int64, device=d), TypeError, "indices"),
    ("decode", 3, lambda d: torch.zeros(3, 1, 64, dtype=torch.int32, device=d), ValueError, "indices"),
    ("decode", 4, lambda d: torch.tensor([1, 1], device=d), TypeError, "topk_length"),
    ("decode", 4, lambda d: torch.tensor([1, 1, 1], dtype=torch.int32, device=d), ValueError, "topk_length"),
    ("decode", 5, lambda d: torch.zeros(32, device=d), ValueError, "attn_sink"),
    ("decode", 5, lambda d: torch.zeros(64, dtype=torch.bfloat16, device=d), TypeError, "attn_sink"),
    ("decode", 8, lambda d: torch.zeros(3, 1, 64, dtype=torch.int32, device=d), ValueError, "extra_indices"),
    ("decode", 9, lambda d: torch.tensor([1, 1], device=d), TypeError, "extra_topk_length"),
    ("decode", 10, lambda d: torch.zeros(4, 8, dtype=torch.int32, device=d), ValueError, "num_splits"),
    ("decode", 13, lambda d: 448, ValueError, "head_dim_v"),
    ("decode", 14, lambda d: "v5", ValueError, "kv_format"),
    ("prefill", 0, lambda d: torch.randn(3, 64, 512, dtype=torch.float16, device=d), TypeError, "q"),
    ("prefill", 0, lambda d: torch.randn(3, 64, 448, dtype=torch.bfloat16, device=d), ValueError, "q"),
    ("prefill", 1, lambda d: torch.randn(6, 512, dtype=torch.bfloat16, device=d), ValueError, "kv"),
    ("prefill", 1, lambda d: torch.randn(6, 1, 512, device=d), TypeError, "kv"),
    ("prefill", 2, lambda d: torch.zeros(3, 2, 128, dtype=torch.int32, device=d), ValueError, "indices"),
    ("prefill", 2, lambda d: torch.zeros(4, 1, 128, dtype=torch.int32, device=d), ValueError, "indices"),
    ("prefill", 4, lambda d: 256, ValueError, "d_v"),
    ("prefill", 5, lambda d: torch.zeros(32, device=d), ValueError, "attn_sink"),
    ("prefill", 6, lambda d: torch.tensor([1, 5, 2], device=d), TypeError, "topk_length"),
    ("prefill", 6, lambda d: torch.tensor([1, 5], dtype=torch.int32, device=d), ValueError, "topk_length"),
]


def unpadded_call(op: str, device) -> list:
    """Well-formed arguments of ``op`` (``"decode"`` / ``"prefill"``) at 64 heads on ``device``:
    batch 2 over a 4-page cache of 64 tokens and a 2-page extra cache of 64; prefill s_q 3 over 6
    rows, top-k 128. (The caches are zeroed: these calls are about argument checks.)"""
    if op == "decode":
        return [
            torch.randn(2, 1, 64, 512, dtype=torch.bfloat16, device=device), d4.alloc_cache(4, 64, device), 64,
            torch.zeros(2, 1, 64, dtype=torch.int32, device=device), torch.ones(2, dtype=torch.int32, device=device),
            torch.zeros(64, device=device), d4.alloc_cache(2, 64, device), 64,
            torch.zeros(2, 1, 64, dtype=torch.int32, device=device), torch.ones(2, dtype=torch.int32, device=device),
            None, None, 0.05, 512, "v4", None,
        ]
    return [
        torch.randn(3, 64, 512, dtype=torch.bfloat16, device=device),
        torch.randn(6, 1, 512, dtype=torch.bfloat16, device=device),
        torch.zeros(3, 1, 128, dtype=torch.int32, device=device), 0.05, 512,
        torch.zeros(64, device=device), torch.ones(3, dtype=torch.int32, device=device),
    ]


def assert_malformed_calls_named(call, device) -> None:
    """Every call of :data:`MALFORMED_UNPADDED` made by ``call(op, *args)`` on ``device`` raises the
    metadata checks' error naming the argument; the well-formed calls run."""
    for op in ("decode", "prefill"):
        call(op, *unpadded_call(op, device))
    for op, position, bad, exc, arg in MALFORMED_UNPADDED:
        args = unpadded_call(op, device)
        args[position] = bad(device)
        with pytest.raises(exc) as info:
            call(op, *args)
        message = str(info.value)
        assert re.search(rf"^dsv4\.\w+: (\S+/)?{re.escape(arg)} must be .*, got ", message), (op, arg, message)


def provider_args(op: str, args) -> tuple:
    """An op's arguments (schema order) as its trampoline hands them to a provider kernel: the
    trailing defaults restored, the cache-format names resolved to ``layout.CacheFormat``."""
    return registry.DEFINED[op].arguments(args)
