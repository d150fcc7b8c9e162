"""The batch-invariant mode (docs/design.md §3, ``dsv4_compile/invariance.py``): a row's outputs
are bit-identical whatever else is in its call.

For each provider that claims the mode for an op, a *probe* row is run alone and at every position
of batches of other sizes whose other rows (its *neighbours*: other queries, lengths from 0 to the
full width, holes) are drawn afresh for each batch; the probe's outputs are compared bitwise. The
index widths are those of the pool the rows come from (the mode's promise is for fixed widths).
And the default mode of the Triton decode is shown *not* to be batch-invariant, so a mode that did
nothing would fail here.

Where it runs: the reference in this process (CPU); the Triton kernels interpreted on CPU in the
``TRITON_INTERPRET=1`` child of :func:`test_interpreted_suite`; both on CUDA (``cuda`` marker),
through the ops as dispatched in the mode, batches up to 256 rows.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    from helpers import patch_triton_interpreter

    patch_triton_interpreter()

import dsv4_compile as d4  # noqa: E402
from dsv4_compile import dispatch, invariance, layout  # noqa: E402
from dsv4_compile.ops import registry  # noqa: E402
from dsv4_compile.providers import reference  # noqa: E402
from helpers import rope_table, run_interpreted_child, store_inputs  # noqa: E402

DECODE, PREFILL = "flash_mla_with_kvcache", "flash_mla_sparse_fwd"
LOGITS, CACHE_LOGITS, TOPK = "indexer_logits", "indexer_cache_logits", "indexer_topk"
SCALE = layout.HEAD_DIM**-0.5
#: Batch sizes the probe is placed in (every position of each): small where kernels are slow.
SIZES = {"cpu": (1, 2, 5), "cuda": (1, 8, 64, 256)}
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child of test_interpreted_suite")


# --------------------------------------------------------------------------------------------
# Running one provider's kernel in the mode
# --------------------------------------------------------------------------------------------


def _triton_kernels() -> dict:
    from dsv4_compile.providers.triton import attention, indexer

    return {**attention.KERNELS, LOGITS: indexer.indexer_logits, CACHE_LOGITS: indexer.indexer_cache_logits,
            TOPK: indexer.indexer_topk}


def served_by(op: str, args, batch_invariant: bool = True) -> str:
    """The provider the dispatcher picks for ``op`` on ``args`` (schema order, without
    ``batch_invariant``): in the mode it depends on the arguments (e.g. FlashMLA serves it only
    for V4.1 interleaved caches on SM100)."""
    defined = registry.DEFINED[op]
    return dispatch.resolve(op, args[0].device, defined.signature(defined.arguments(args)),
                            batch_invariant=batch_invariant)[0]


def run(provider: str, op: str, args, batch_invariant: bool = True):
    """``op`` on ``args`` (schema order, without ``batch_invariant``) by ``provider``: on CUDA
    through the op as dispatched (``provider`` must be the one that serves the mode there), on CPU
    its kernel directly (the Triton ones interpreted)."""
    defined = registry.DEFINED[op]
    if args[0].is_cuda:
        extra = {"batch_invariant": batch_invariant} if op in dispatch.INVARIANT_OPS else {}
        name = served_by(op, args, batch_invariant)
        assert name == provider, f"{op} in the mode is served by {name!r} on CUDA, not {provider!r}"
        return getattr(torch.ops.dsv4, op)(*args, **extra)
    full = list(defined.arguments(args))
    if defined.invariant_at is not None:
        full[defined.invariant_at] = batch_invariant
    kernels = reference.KERNELS if provider == "reference" else _triton_kernels()
    return kernels[op](*full)


def outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


# --------------------------------------------------------------------------------------------
# Pools of rows: the probe (row 0) and its possible neighbours, over shared caches
# --------------------------------------------------------------------------------------------


def _filled(pages: int, page_size: int, fmt: str) -> torch.Tensor:
    cache = layout.alloc_cache(pages, page_size, kv_format=fmt)
    n = pages * page_size
    kv, w, freqs, pos = store_inputs(n, max_pos=256)
    reference.fused_k_norm_rope_flashmla(kv, w, freqs, pos, torch.arange(n), cache, 1e-6, page_size, layout.FORMATS[fmt])
    return cache


def _lengths(n: int, width: int) -> torch.Tensor:
    """Lengths of ``n`` rows: the probe's random, then 0, the full width and random ones."""
    lengths = torch.randint(0, width + 1, (n,), dtype=torch.int32)
    lengths[0] = max(1, int(lengths[0]))
    lengths[1:3] = torch.tensor([0, width], dtype=torch.int32)[: max(0, min(2, n - 1))]
    return lengths


def _holed(shape, cap: int) -> torch.Tensor:
    idx = torch.randint(0, cap, shape, dtype=torch.int32)
    return torch.where(torch.rand(shape) < 0.15, -1, idx)


def decode_pool(n: int, heads: int = 16, s_q: int = 1, width: int = 200, extra_width: int = 150,
                extra: bool = True, kv_format: str = "v4", extra_format: str | None = None, device="cpu"):
    """Decode arguments of ``n`` rows over a window-like cache (P = 64) and, if ``extra``, a
    compressed-like extra cache (P = 64)."""
    cache = _filled(4, 64, kv_format)
    args = [torch.randn(n, s_q, heads, layout.HEAD_DIM).to(torch.bfloat16), cache, 64,
            _holed((n, s_q, width), 256), _lengths(n, width), torch.randn(heads) * 2, None, 1, None, None,
            None, None, SCALE, layout.HEAD_DIM, kv_format, None]
    if extra:
        fmt = extra_format or kv_format
        args[6:10] = [_filled(4, 64, fmt), 64, _holed((n, s_q, extra_width), 256), _lengths(n, extra_width)]
        args[15] = extra_format
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def prefill_pool(n: int, heads: int = 16, width: int = 160, s_kv: int = 300, device="cpu"):
    args = [torch.randn(n, heads, layout.HEAD_DIM).to(torch.bfloat16),
            torch.randn(s_kv, 1, layout.HEAD_DIM).to(torch.bfloat16),
            torch.randint(-2, s_kv + 2, (n, 1, width), dtype=torch.int32), SCALE, layout.HEAD_DIM,
            torch.randn(heads) * 2, _lengths(n, width)]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def logits_pool(n: int, heads: int = 8, width: int = 90, slots: int = 64, device="cpu"):
    block_slots = torch.randint(0, slots, (n, width))
    block_slots = torch.where(torch.arange(width) < _lengths(n, width)[:, None], block_slots, -1)
    args = [torch.randn(n, heads, 128), torch.randn(n, heads) / heads**0.5, torch.randn(slots, 128), block_slots]
    return [a.to(device) for a in args]


def cache_logits_pool(n: int, name: str, heads: int = 8, width: int = 90, page_size: int = 16, device="cpu"):
    cache = layout.alloc_index_cache(4, page_size, index_format=name)
    keys = torch.randn(4 * page_size, layout.INDEX_HEAD_DIM)
    reference.indexer_store(keys, cache, torch.arange(4 * page_size), page_size, layout.INDEX_FORMATS[name])
    q = torch.randn(n, heads, layout.INDEX_HEAD_DIM) * 2
    codes, q_scales = layout.quantize_index(layout.hadamard(q) if name != "fp32" else q, name)
    weights = torch.randn(n, heads) / heads**0.5
    if name == "fp8":
        weights, q_scales = weights * q_scales, None
    block_slots = torch.randint(0, 4 * page_size, (n, width))
    block_slots = torch.where(torch.arange(width) < _lengths(n, width)[:, None], block_slots, -1)
    args = [codes, weights, cache, block_slots, page_size, name, q_scales]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def topk_pool(n: int, width: int = 300, k: int = 40, device="cpu"):
    logits = torch.randn(n, width).round(decimals=1)  # ties
    logits[:, ::7] = -float("inf")
    return [logits.to(device), k]


#: Per op, the arguments that hold one entry per row (dim 0).
ROW_ARGS = {DECODE: (0, 3, 4, 8, 9), PREFILL: (0, 2, 6), LOGITS: (0, 1, 3), CACHE_LOGITS: (0, 1, 3, 6), TOPK: (0,)}


def batch_of(op: str, pool: list, rows: list[int]) -> list:
    """The arguments of a call over the pool's ``rows`` (in that order)."""
    args = list(pool)
    index = torch.tensor(rows, dtype=torch.long)
    for i in ROW_ARGS[op]:
        if args[i] is not None:
            args[i] = args[i][index.to(args[i].device)].clone()
    return args


def assert_probe_invariant(provider: str, op: str, pool: list, sizes, seed: int = 0, batch_invariant: bool = True) -> int:
    """Run the probe (pool row 0) alone, then at every position of a batch of each size in
    ``sizes`` among neighbours drawn afresh from the pool; its outputs equal bit for bit. Returns
    the calls made. (``batch_invariant=False``: the same in the default mode.)"""
    rng = random.Random(seed)
    alone = outputs(run(provider, op, batch_of(op, pool, [0]), batch_invariant))
    calls = 1
    for size in sizes:
        for position in range(size):
            rows = [rng.randrange(1, len(pool[0])) for _ in range(size - 1)]
            rows.insert(position, 0)
            got = outputs(run(provider, op, batch_of(op, pool, rows), batch_invariant))
            calls += 1
            for k, (a, b) in enumerate(zip(alone, got)):
                assert torch.equal(a[0], b[position]), (
                    f"{provider} {op}: output {k} of the probe at position {position} of {size} rows "
                    f"differs from the probe alone (max diff {(a[0].float() - b[position].float()).abs().max()})"
                )
    return calls


def cases(device: str):
    """``(op, pool)`` of every op the mode covers, on ``device``."""
    yield DECODE, decode_pool(40, device=device)
    yield DECODE, decode_pool(40, extra=False, device=device)
    yield DECODE, decode_pool(40, kv_format="v4.1-fp8", extra_format="v4.1-fp4", device=device)
    yield PREFILL, prefill_pool(40, device=device)
    yield LOGITS, logits_pool(40, device=device)
    for name in layout.INDEX_FORMATS:
        yield CACHE_LOGITS, cache_logits_pool(40, name, device=device)
    yield TOPK, topk_pool(40, device=device)


# --------------------------------------------------------------------------------------------
# Bitwise invariance, per provider
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETED, reason="the reference runs in the parent process")
def test_reference_rows_are_batch_invariant():
    for op, pool in cases("cpu"):
        assert_probe_invariant("reference", op, pool, SIZES["cpu"])


@interpreted
def test_triton_rows_are_batch_invariant_interpreted():
    for op, pool in cases("cpu"):
        assert_probe_invariant("triton", op, pool, (1, 3, 6))


@pytest.mark.cuda
def test_cuda_rows_are_batch_invariant():
    """On the GPU, through the ops as the mode dispatches them (the Triton kernels on SM90;
    batches of 1 to 256 rows, the probe at every position)."""
    for op, pool in cases("cuda"):
        assert_probe_invariant(served_by(op, pool), op, pool, SIZES["cuda"])


def _assert_invariant_at_split_sizes(device: str, sizes) -> None:
    """The Triton decode in the mode at other split sizes (``DSV4_COMPILE_INVARIANT_SPLIT_KEYS``):
    still invariant at each, and the size is used (the probe's lse bits differ between sizes)."""
    from dsv4_compile.providers.triton import attention

    pool = decode_pool(40, device=device)
    probe = batch_of(DECODE, pool, [0])
    before, lses = attention.INVARIANT_SPLIT_KEYS, []
    try:
        for keys in (64, 640):
            attention.INVARIANT_SPLIT_KEYS = keys
            assert_probe_invariant("triton", DECODE, pool, sizes)
            lses.append(outputs(run("triton", DECODE, probe))[1])
    finally:
        attention.INVARIANT_SPLIT_KEYS = before
    assert not torch.equal(*lses), "the probe's lse is the same at 64 and 640 keys per split"


@interpreted
def test_triton_rows_are_batch_invariant_at_other_split_sizes_interpreted():
    _assert_invariant_at_split_sizes("cpu", (1, 4))


@pytest.mark.cuda
def test_cuda_rows_are_batch_invariant_at_other_split_sizes():
    _assert_invariant_at_split_sizes("cuda", SIZES["cuda"])


def test_split_size_from_the_environment(monkeypatch):
    from dsv4_compile.providers.triton import attention

    read, name = attention.invariant_split_keys_from_environment, attention.INVARIANT_SPLIT_KEYS_ENV
    monkeypatch.delenv(name, raising=False)
    assert read() == attention.DEFAULT_INVARIANT_SPLIT_KEYS == 256
    monkeypatch.setenv(name, "640")
    assert read() == 640
    for bad in ("100", "0", "-64", "many"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"DSV4_COMPILE_INVARIANT_SPLIT_KEYS must be a positive multiple of 64 "
                                             rf"\(keys per split of a row in the batch-invariant mode\), got '{bad}'"):
            read()


@pytest.mark.parametrize("value, printed", [("640", "640"), ("", "256"), ("100", "ValueError")])
def test_split_size_is_read_when_the_package_is_imported(value, printed):
    """A fresh process: the variable sets the kernels' split size at ``import dsv4_compile``, and a
    bad value fails that import (not a later call, nor a provider silently skipped)."""
    code = ("try:\n import dsv4_compile\nexcept ValueError:\n print('ValueError')\nelse:\n"
            " from dsv4_compile.providers.triton import attention\n print(attention.INVARIANT_SPLIT_KEYS)")
    env = {**os.environ, "DSV4_COMPILE_INVARIANT_SPLIT_KEYS": value}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == [printed], done.stderr[-2000:]


def _mtp_case(device):
    """Decode arguments with ``s_q = 2`` (an MTP-style step) over the pool of :func:`decode_pool`."""
    return decode_pool(12, s_q=2, device=device)


def _assert_mtp_equals_single(provider, pool):
    """Each query of an ``s_q = 2`` step equals the same query decoded as an ``s_q = 1`` row."""
    out, lse = run(provider, DECODE, pool)
    for s in range(2):
        single = list(pool)
        for i in (0, 3, 8):
            single[i] = pool[i][:, s : s + 1].clone()
        one, one_lse = run(provider, DECODE, single)
        assert torch.equal(one[:, 0], out[:, s]) and torch.equal(one_lse[:, :, 0], lse[:, :, s]), (provider, s)


@pytest.mark.skipif(INTERPRETED, reason="the reference runs in the parent process")
def test_reference_mtp_query_equals_its_single_decode():
    _assert_mtp_equals_single("reference", _mtp_case("cpu"))


@interpreted
def test_triton_mtp_query_equals_its_single_decode_interpreted():
    _assert_mtp_equals_single("triton", _mtp_case("cpu"))


@pytest.mark.cuda
def test_cuda_mtp_query_equals_its_single_decode():
    pool = _mtp_case("cuda")
    _assert_mtp_equals_single(served_by(DECODE, pool), pool)


def _assert_default_decode_not_invariant(provider, device, sizes):
    """The default (split by the batch) Triton decode gives some probe other bits in a larger
    batch than alone: the mode is needed, and a mode that did nothing would fail the tests above."""
    differs = 0
    for seed in range(4):
        torch.manual_seed(seed)
        pool = decode_pool(300, device=device)
        try:
            assert_probe_invariant(provider, DECODE, pool, sizes, seed, batch_invariant=False)
        except AssertionError:
            differs += 1
    assert differs, "the default Triton decode was batch-invariant in every trial"


@interpreted
def test_triton_default_decode_is_not_batch_invariant_interpreted():
    _assert_default_decode_not_invariant("triton", "cpu", (8,))


@pytest.mark.cuda
def test_cuda_default_decode_is_not_batch_invariant():
    with d4.use_provider("triton", ops=(DECODE,)):
        _assert_default_decode_not_invariant("triton", "cuda", (256,))


def _assert_empty_calls(provider):
    """No rows, and rows over no index columns, in the mode: empty outputs (``out = 0``, ``lse =
    +inf``), no error."""
    pool = decode_pool(3, width=0, extra_width=0)
    out, lse = run(provider, DECODE, batch_of(DECODE, pool, [0, 1]))
    assert not out.any() and bool((lse == float("inf")).all())
    out, lse = run(provider, DECODE, batch_of(DECODE, pool, []))
    assert out.shape[0] == 0 and lse.shape[0] == 0
    out, max_logits, lse = run(provider, PREFILL, batch_of(PREFILL, prefill_pool(3), []))
    assert out.shape[0] == 0


@pytest.mark.skipif(INTERPRETED, reason="the reference runs in the parent process")
def test_reference_empty_calls_in_the_mode():
    _assert_empty_calls("reference")


@interpreted
def test_triton_empty_calls_in_the_mode_interpreted():
    _assert_empty_calls("triton")


def test_interpreted_suite(request):
    """Run the ``interpreted`` tests in a child pytest with ``TRITON_INTERPRET=1``."""
    run_interpreted_child(request.config, __file__)


# --------------------------------------------------------------------------------------------
# The ops that need no argument: row-wise on every provider
# --------------------------------------------------------------------------------------------


def _store_probe(provider: str, batch: int, position: int, fmt: str) -> torch.Tensor:
    """The bytes the fused store writes for one token stored among ``batch`` tokens at
    ``position`` (the others random, at other slots)."""
    torch.manual_seed(1)
    probe = store_inputs(1, max_pos=64)
    torch.manual_seed(100 + batch * 31 + position)
    kv, w, freqs, pos = store_inputs(batch, max_pos=64)
    kv[position], pos[position] = probe[0][0], probe[3][0]
    w, freqs = probe[1], rope_table(64)
    cache = layout.alloc_cache(2, 256, kv_format=fmt)
    slots = torch.randperm(512)[:batch]
    slots[position] = 7
    kernel = reference.fused_k_norm_rope_flashmla if provider == "reference" else _triton_store()
    kernel(kv, w, freqs, pos, slots, cache, 1e-6, 256, layout.FORMATS[fmt])
    fmt = layout.FORMATS[fmt]
    return torch.cat([layout.data_records(cache, 256, fmt)[0, 7], layout.scale_records(cache, 256, fmt)[0, 7]])


def _triton_store():
    from dsv4_compile.providers.triton import store

    return store.fused_k_norm_rope_flashmla


@pytest.mark.parametrize("fmt", ["v4", "v4.1-fp8"])
@pytest.mark.parametrize("provider", [
    pytest.param("reference", marks=pytest.mark.skipif(INTERPRETED, reason="parent process")),
    pytest.param("triton", marks=interpreted),
])
def test_store_writes_a_token_whatever_the_batch(provider, fmt):
    alone = _store_probe(provider, 1, 0, fmt)
    for batch, position in ((5, 0), (5, 3), (40, 39)):
        assert torch.equal(_store_probe(provider, batch, position, fmt), alone), (batch, position)


# --------------------------------------------------------------------------------------------
# The switch, dispatch and compile
# --------------------------------------------------------------------------------------------

SPY = "invariance_spy"


@pytest.fixture
def spy():
    """A provider above the reference on CPU that serves the decode without a batch-invariant
    kernel (until ``claim_invariance()``), recording each call's ``batch_invariant`` argument."""
    class Seen(list):
        def claim_invariance(self):
            """Declare the spy's decode batch-invariant (it is the reference's)."""
            register(invariant={DECODE: None})

    seen = Seen()

    def decode(*args):
        seen.append(args[-1])
        return reference.flash_mla_with_kvcache(*args)

    def register(**kwargs):
        dispatch.register_provider(dispatch.Provider(SPY, "cpu", lambda device: {DECODE: decode}, ops=(DECODE,),
                                                     priority=500, **kwargs))

    register()
    dispatch.reset()
    yield seen
    dispatch.unregister_provider(SPY, "cpu")
    dispatch.reset()


def _decode_args():
    return decode_pool(3, heads=4, width=20, extra_width=10)


def test_a_provider_without_an_invariant_kernel_is_skipped_once_with_a_warning(spy):
    args = _decode_args()
    d4.flash_mla_with_kvcache(*args[:15])
    assert spy == [False]
    with pytest.warns(RuntimeWarning, match=f"batch-invariant mode uses provider 'reference'; skipped '{SPY}'"):
        with d4.batch_invariant():
            d4.flash_mla_with_kvcache(*args[:15])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d4.flash_mla_with_kvcache(*args[:15], batch_invariant=True)  # said once
    assert spy == [False]  # the mode's calls went to the reference


def test_providers_and_chain_show_the_mode(spy):
    assert d4.providers("cpu")[DECODE] == SPY
    assert d4.providers("cpu", batch_invariant=True)[DECODE] == "reference"
    assert d4.provider_chain("cpu")[DECODE][0][0] == SPY
    assert [name for name, _ in d4.provider_chain("cpu", batch_invariant=True)[DECODE]] == ["reference"]
    with d4.batch_invariant():
        assert d4.providers("cpu")[DECODE] == "reference"
    # the ops without the argument are row-wise on every provider: the mode changes nothing there
    assert d4.providers("cpu", batch_invariant=True)["indexer_topk"] == d4.providers("cpu")["indexer_topk"]


def test_a_forced_provider_without_an_invariant_kernel_is_an_error(spy):
    with d4.use_provider(SPY, ops=(DECODE,)):
        with pytest.raises(dispatch.ProviderUnavailable, match=f"'{SPY}' has no batch-invariant kernel"):
            d4.flash_mla_with_kvcache(*_decode_args()[:15], batch_invariant=True)


def test_switch_context_setter_and_environment(monkeypatch):
    assert not invariance.enabled()
    with d4.batch_invariant():
        assert invariance.enabled()
        with d4.batch_invariant(False):
            assert not invariance.enabled()
        assert invariance.enabled()
    assert not invariance.enabled()
    monkeypatch.setenv(invariance.ENV, "1")
    dispatch.reset()
    try:
        assert invariance.enabled()
        d4.set_batch_invariant(False)
        assert not invariance.enabled()
        d4.set_batch_invariant(None)  # back to the environment's
        assert invariance.enabled()
    finally:
        monkeypatch.delenv(invariance.ENV)
        dispatch.reset()
    assert not invariance.enabled()


def test_wrappers_pass_the_switch_and_an_explicit_argument_wins(spy):
    args = _decode_args()
    spy.claim_invariance()
    d4.flash_mla_with_kvcache(*args[:15])
    with d4.batch_invariant():
        d4.flash_mla_with_kvcache(*args[:15])
        d4.flash_mla_with_kvcache(*args[:15], batch_invariant=False)
    torch.ops.dsv4.flash_mla_with_kvcache(*args, batch_invariant=True)
    assert spy == [False, True, False, True]


def test_a_bad_batch_invariant_argument_is_named():
    args = _decode_args()
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        d4.ops.decode.check_decode(*registry.DEFINED[DECODE].arguments(args)[:-1], "yes")


def test_compat_enable_batch_invariant_asks_for_the_mode(spy):
    from dsv4_compile.compat import flash_mla

    spy.claim_invariance()
    q, cache, page_size, idx, lengths, sink = _decode_args()[:6]
    view = layout.flashmla_view(cache, page_size)
    common = dict(indices=idx, attn_sink=sink, topk_length=lengths, is_fp8_kvcache=True)
    flash_mla.flash_mla_with_kvcache(q, view, None, None, 512, None, **common)
    flash_mla.flash_mla_with_kvcache(q, view, None, None, 512, None, enable_batch_invariant=True, **common)
    assert spy == [False, True]
    # a scheduler object filled outside the mode is not reused in it (as upstream)
    sched, _ = flash_mla.get_mla_metadata()
    flash_mla.flash_mla_with_kvcache(q, view, None, None, 512, sched, **common)
    with pytest.raises(ValueError, match="enable_batch_invariant"):
        flash_mla.flash_mla_with_kvcache(q, view, None, None, 512, sched, enable_batch_invariant=True, **common)


def test_compiled_wrapper_recompiles_when_the_switch_flips(spy):
    """The wrappers read the switch in Python, so ``torch.compile`` guards on it: flipping it
    re-traces, and the compiled call then asks for the mode (no stale graph)."""
    spy.claim_invariance()
    args = _decode_args()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda *a: d4.flash_mla_with_kvcache(*a), backend=backend, fullgraph=True)
    fn(*args[:15])
    with d4.batch_invariant():
        fn(*args[:15])
    fn(*args[:15])
    assert spy == [False, True, False]
    assert len(frames) == 2
    torch._dynamo.reset()
