"""Every Triton kernel of the package compiles for NVIDIA GPUs (SM80, SM89, SM90, SM100, SM120), on a
machine without one, to real code (not a bare trap) within the shared memory a program may take there.

The interpreter (``TRITON_INTERPRET=1``: the CPU runs of the kernel tests) executes a kernel's
Python and accepts code the compiler refuses: a launch argument the kernel does not have, a
re-assigned ``constexpr``. Here each provider entry point runs on CPU tensors with its launches
recorded instead of run (``tests/triton_offline.py``). Each recorded launch gives the kernel's
signature (tensor dtypes, int widths, Triton's specialisation of 1 and of multiples of 16) and its
``constexpr`` values, and ``triton.compile`` builds it for each target, through PTX to a cubin,
with the ``ptxas`` that Triton ships.

The launches take the choices a GPU of that capability gets: the launch geometries
(``triton_attention``'s by capability, the prefill's also by shared memory per block), 3xTF32
indexer logits, and the fp8 / bf16 conversion instructions from SM89 on (so SM80 compiles the
integer-arithmetic conversions).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles, does not interpret")

triton = pytest.importorskip("triton")
#: The Triton versions whose offline ``triton.compile(ASTSource(...))`` this test drives (the
#: pinned CI job's and the GPU machine's); on others it skips rather than test the harness.
CHECKED_TRITON = ("3.6.",)
if not triton.__version__.startswith(CHECKED_TRITON):
    pytest.skip(f"the offline compile check drives Triton {CHECKED_TRITON}, not {triton.__version__}",
                allow_module_level=True)

import dsv4_compile as d4  # noqa: E402
from dsv4_compile import layout  # noqa: E402
from dsv4_compile.providers.flashmla import schedule as flashmla_schedule  # noqa: E402
from dsv4_compile.providers.triton import (  # noqa: E402
    attention as triton_attention, indexer as triton_indexer, rope as triton_rope, store as triton_store,
)
import triton_offline  # noqa: E402  (this directory's tool)


def calls():
    """One call of each provider entry point per kernel variant the GPU paths launch (CPU tensors)."""
    g = torch.Generator().manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16)
    for kv_format in layout.FORMATS.values():  # providers receive CacheFormat objects
        cache = layout.alloc_cache(4, 8, "cpu", kv_format=kv_format)
        for tokens in (5, triton_store.SMALL_TOKENS + 1):  # both launch geometries (recorded, not run)
            kv = torch.randn(tokens, 512, generator=g, **bf16)
            slots = torch.arange(tokens)
            yield triton_store.fused_k_norm_rope_flashmla, (
                kv, torch.ones(512, **bf16), torch.randn(16, 64, generator=g), slots, slots, cache, 1e-6, 8,
                kv_format,
            )
            yield triton_store.quantize_store, (kv, slots, cache, 8, kv_format)
    cache = layout.alloc_cache(4, 64, "cpu")
    # split (+ combine) into one-block splits (one-stage loops), into splits of several blocks, and
    # not split (4 SMs while recorded)
    for rows, extra, lengths, x_width in ((1, True, True, 128), (2, True, False, 512), (64, False, False, 0)):
        q = torch.randn(rows, 1, 64, 512, generator=g, **bf16)
        idx = torch.randint(0, 256, (rows, 1, 128), dtype=torch.int32, generator=g)
        x_idx = torch.randint(0, 256, (rows, 1, x_width), dtype=torch.int32, generator=g)
        length = torch.full((rows,), 100, dtype=torch.int32) if lengths else None
        yield triton_attention.flash_mla_with_kvcache, (
            q, cache, 64, idx, length, torch.zeros(64) if lengths else None,
            cache if extra else None, 64, x_idx if extra else None, length if extra else None,
            None, None, 0.05, 512, layout.V4, layout.V41_FP4 if extra else None,
        )
    # the batch-invariant mode: fixed splits with a combine (a row's programs past its splits
    # return at once), and a launch of one split per row (its rows write their outputs themselves)
    for x_width in (512, 0):
        q = torch.randn(3, 2, 64, 512, generator=g, **bf16)
        idx = torch.randint(0, 256, (3, 2, 128), dtype=torch.int32, generator=g)
        x_idx = torch.randint(0, 256, (3, 2, x_width), dtype=torch.int32, generator=g)
        length = torch.full((3,), 100, dtype=torch.int32)
        yield triton_attention.flash_mla_with_kvcache, (
            q, cache, 64, idx, length, torch.zeros(64), cache if x_width else None, 64, x_idx if x_width else None,
            length if x_width else None, None, None, 0.05, 512, layout.V4, None, True,
        )
    for dim in (512, 576):
        kv = torch.randn(300, 1, dim, generator=g, **bf16)
        idx = torch.randint(0, 300, (7, 1, 128), dtype=torch.int32, generator=g)
        yield triton_attention.flash_mla_sparse_fwd, (
            torch.randn(7, 64, dim, generator=g, **bf16), kv, idx, 0.05, 512, torch.zeros(64), torch.full((7,), 90, dtype=torch.int32),
        )
    for lengths, extra in ((True, True), (False, False)):
        length = torch.full((3,), 100, dtype=torch.int32)
        yield flashmla_schedule.schedule, (
            length if lengths else None, length if lengths and extra else None, 128, 64 if extra else 0, (132, 8), 3, torch.device("cpu"),
        )
    length = torch.full((3,), 100, dtype=torch.int32)  # the model's three layer kinds in one launch
    yield flashmla_schedule.schedules, (
        [(length, None, 128, 0), (length, length, 128, 512), (length, length, 128, 64)], (132, 8), 3, torch.device("cpu"),
    )
    for dim in (128, 200):  # the wide geometry past 128
        slots = torch.randint(-1, 9, (3, 70), generator=g)
        yield triton_indexer.indexer_logits, (torch.randn(3, 64, dim), torch.randn(3, 64), torch.randn(9, dim), slots)
    for name in ("fp32", "fp8", "fp4"):  # the paged indexer key cache's store and logits
        fmt = layout.INDEX_FORMATS[name]
        cache = layout.alloc_index_cache(3, 8, name)
        slots = torch.randint(-1, 24, (5,), generator=g)
        yield triton_indexer.indexer_store, (torch.randn(5, 128), cache, slots, 8, fmt)
        codes, scales = layout.quantize_index(torch.randn(3, 64, 128), name)
        block_slots = torch.randint(-1, 24, (3, 70), generator=g)
        yield triton_indexer.indexer_cache_logits, (codes, torch.randn(3, 64), cache, block_slots, 8, fmt,
                                                    scales if name == "fp4" else None)
        # through a block table: the tile kernel (fp8: e4m3 products from SM89) and the per-row
        # kernel beside it (every row for fp32), and the per-row kernel alone (batch-invariant)
        table, rows, lengths = torch.tensor([[2, 0, 1]]), torch.zeros(3, dtype=torch.int32), torch.tensor([3, 9, 20])
        for invariant in (False, True):
            yield triton_indexer.table_logits, (codes, torch.randn(3, 64), cache, table, rows, lengths, 8, 24, fmt,
                                                scales if name == "fp4" else None, invariant)
    # 4 and 8 warps in registers; by pieces (one step from the logits, then one from keys to
    # keys, then the last); a k past a quarter of a piece: the widest rows in registers, then the
    # looped program
    for width in (1024, triton_indexer.TOPK_CHUNK, 8 * triton_indexer.TOPK_CHUNK + 1):
        yield triton_indexer.indexer_topk, (torch.randn(3, width), 512)
    k = triton_indexer.TOPK_CHUNK // 4 + 1
    for width in (triton_indexer.TOPK_MAX_WIDTH, triton_indexer.TOPK_MAX_WIDTH + 1):
        yield triton_indexer.indexer_topk, (torch.randn(3, width), k)
    for shape, dtype, inverse in (((5, 4, 512), torch.bfloat16, True), ((3, 100), torch.float32, False)):
        yield triton_rope.rope_, (torch.randn(shape, dtype=dtype), torch.randn(16, 64), torch.arange(shape[0]), inverse)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)],
                         ids=["sm80", "sm89", "sm90", "sm100", "sm120"])
def test_every_kernel_compiles(capability, request):
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    for module in (triton_store, triton_attention, flashmla_schedule, triton_indexer, triton_rope):
        module._kernels()
    with triton_offline.recorded(capability) as launches:
        for entry, args in calls():
            entry(*args)
        prefill = triton_attention.prefill_config(torch.device("cuda"))  # the geometry this GPU gets
    limit = triton_offline.SHARED_PER_BLOCK[capability]
    seen, compiled, prefill_shared = set(), {}, 0
    for kernel, args, kwargs in launches:
        signature, constexprs, attrs, options = triton_offline.specialization(kernel, args, kwargs)
        key = (kernel.fn.__name__, repr((signature, constexprs, attrs, options)))
        if key in seen:
            continue
        seen.add(key)
        binary = triton_offline.compile_launch(kernel, args, kwargs, capability[0] * 10 + capability[1])
        assert binary.asm["cubin"], kernel.fn.__name__
        assert "trap;" not in binary.asm["ptx"], f"{kernel.fn.__name__} {constexprs}: compiled to a trap"
        columns = getattr(binary.metadata, "tmem_size", 0)  # SM100 tensor memory: 512 columns per SM
        assert columns <= 512, f"{kernel.fn.__name__} {constexprs}: {columns} tensor-memory columns of 512"
        shared = binary.metadata.shared
        assert shared <= limit, f"{kernel.fn.__name__} {constexprs}: {shared} B of shared memory, {limit} B per block"
        if kernel.fn.__name__ == "prefill_kernel":
            prefill_shared = max(prefill_shared, shared)
        compiled[kernel.fn.__name__] = compiled.get(kernel.fn.__name__, 0) + 1
    expected = {"store_kernel", "store_v41_kernel", "decode_kernel", "combine_kernel", "prefill_kernel",
                "schedule_kernel", "logits_kernel", "topk_kernel", "topk_looped_kernel", "rope_kernel",
                "index_store_kernel", "cache_logits_kernel", "tile_logits_kernel"}
    assert set(compiled) == expected, compiled
    # the figure prefill_config's rule reads (the launches above: 64 heads, 512- and 576-dim queries)
    assert prefill_shared == prefill.shared_bytes, (prefill, prefill_shared)
    from helpers import report

    report(request.config, f"triton compile sm{capability[0]}{capability[1]}: "
                           + ", ".join(f"{name} x{n}" for name, n in sorted(compiled.items())))
