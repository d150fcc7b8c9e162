"""The reference's memory is bounded: each op's peak RSS stays within its outputs plus
``reference.CHUNK_BYTES`` (and allocator slack), whatever the batch, head count or index width.

The reference serves CPU, is the fallback on every device and is the test oracle: a 512-row decode
over 2048 keys must not cost gigabytes. Each case runs in a fresh process, which resets its peak
(``VmHWM``, via ``/proc/self/clear_refs``) after building the inputs and measures the call.

The child runs with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``). By default glibc
raises the threshold to the size of each large block freed, so later blocks of that size come from
the heap and stay resident after they are freed: the peak then depends on the order of frees, and a
case measured 33 or 63 MB from run to run. With the threshold fixed every large tensor is mapped
and unmapped with its lifetime, and the RSS follows the live tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dsv4_compile.providers import reference

SLACK = 16 << 20  # allocator and interpreter noise
MMAP_THRESHOLD = 1 << 20  # glibc: blocks of 1 MiB or more are mapped, and unmapped when freed

SCRIPT = textwrap.dedent(
    """
    import sys, torch, dsv4_compile as d4
    torch.set_num_threads(2)

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    c = d4.alloc_cache(2, 4)  # warm-up with small inputs: lazy initialisation, thread pools
    d4.fused_k_norm_rope_flashmla(torch.randn(3, 512, dtype=torch.bfloat16), torch.ones(512, dtype=torch.bfloat16),
                                  torch.randn(8, 64), torch.arange(3), torch.arange(3), c, 1e-6, 4)
    d4.flash_mla_with_kvcache(torch.randn(2, 1, 8, 512, dtype=torch.bfloat16), c, 4, torch.zeros(2, 1, 5, dtype=torch.int32))
    d4.flash_mla_sparse_fwd(torch.randn(2, 8, 512, dtype=torch.bfloat16), torch.randn(3, 1, 512, dtype=torch.bfloat16),
                            torch.zeros(2, 1, 5, dtype=torch.int32), 0.1)

    op = sys.argv[1]
    if op == "decode":  # B=512 rows, H=64, 2048 indices, every one valid
        q = torch.empty(512, 1, 64, 512, dtype=torch.bfloat16).normal_()
        cache = d4.alloc_cache(64, 64)
        idx = torch.randint(0, 64 * 64, (512, 1, 2048), dtype=torch.int32)
        run = lambda: d4.flash_mla_with_kvcache(q, cache, 64, idx)
        outputs = q.numel() * 2 + 512 * 64 * 4
    elif op == "prefill":  # s_q=512, H=64, 2048 indices into 4096 rows
        q = torch.empty(512, 64, 512, dtype=torch.bfloat16).normal_()
        kv = torch.empty(4096, 1, 512, dtype=torch.bfloat16).normal_()
        idx = torch.randint(0, 4096, (512, 1, 2048), dtype=torch.int32)
        run = lambda: d4.flash_mla_sparse_fwd(q, kv, idx, 0.04)
        outputs = q.numel() * 2 + 2 * 512 * 64 * 4
    elif op == "indexer":  # T=512 rows, H=64 x 128, 4096 blocks each: 1.5 GB if gathered at once
        q, w = torch.randn(512, 64, 128), torch.randn(512, 64)
        keys = torch.randn(8192, 128)
        slots = torch.randint(0, 8192, (512, 4096))
        run = lambda: d4.indexer_logits(q, w, keys, slots)
        outputs = 512 * 4096 * 4
    elif op == "index_store":  # 262144 keys into an FP4 indexer cache: ~1 GB of temporaries at once
        cache = d4.layout.alloc_index_cache(4096, 64, "fp4")
        keys, slots = torch.randn(262144, 128), torch.randperm(262144)
        run = lambda: d4.indexer_store(keys, cache, slots, 64, "fp4")
        outputs = 0
    elif op == "index_logits":  # the indexer case above over an FP4 cache: 2 GB if gathered at once
        cache = d4.layout.alloc_index_cache(128, 64, "fp4")
        d4.indexer_store(torch.randn(8192, 128), cache, torch.arange(8192), 64, "fp4")
        codes, scales = d4.layout.quantize_index(torch.randn(512, 64, 128), "fp4")
        w, slots = torch.randn(512, 64), torch.randint(0, 8192, (512, 4096))
        run = lambda: d4.indexer_cache_logits(codes, w, cache, slots, 64, "fp4", scales)
        outputs = 512 * 4096 * 4
    elif op == "index_select":  # T=256 rows (4 heads) over a table of 65536 blocks: 192 MB of slots and logits at once
        cache = d4.layout.alloc_index_cache(1024, 64, "fp8")
        codes, scales = d4.layout.quantize_index(torch.randn(256, 4, 128), "fp8")
        w = torch.randn(256, 4) * scales
        table = torch.randperm(1024, dtype=torch.int32)[None]
        run = lambda: d4.indexer_cache_topk(codes, w, cache, table, torch.zeros(256, dtype=torch.long),
                                            torch.full((256,), 65536), 64, 512, "fp8")
        outputs = 256 * 512 * 8
    elif op == "topk":  # T=65536 rows (a prefill's), 1024 blocks each: 1.5 GB if sorted at once
        logits = torch.randn(65536, 1024)
        run = lambda: d4.indexer_topk(logits, 512)
        outputs = 65536 * 512 * 8
    elif op == "rope":  # T=8192 tokens x H=64 heads of 512 (512 MB, in place): ~390 MB of temporaries unchunked
        x = torch.empty(8192, 64, 512, dtype=torch.bfloat16).normal_()
        freqs, pos = torch.randn(8192, 64), torch.arange(8192)
        run = lambda: d4.rope_(x, freqs, pos, True)
        outputs = 0
    else:  # the store: 65536 tokens
        cache = d4.alloc_cache(256, 256)
        kv = torch.empty(65536, 512, dtype=torch.bfloat16).normal_()
        w, freqs = torch.ones(512, dtype=torch.bfloat16), torch.randn(65536, 64)
        pos, slots = torch.arange(65536), torch.randperm(65536)
        run = lambda: d4.fused_k_norm_rope_flashmla(kv, w, freqs, pos, slots, cache, 1e-6, 256)
        outputs = 0
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    result = run()
    print(status("VmHWM") - before, outputs)
    """
)


def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _clear_refs_works(),
                    reason="needs Linux's /proc/self/clear_refs to reset the peak RSS")
@pytest.mark.parametrize(
    "op", ["decode", "prefill", "store", "indexer", "index_store", "index_logits", "index_select", "topk", "rope"]
)
def test_peak_memory_is_bounded(op, request):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env.pop("DSV4_COMPILE_PROVIDER", None)
    env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    child = subprocess.run([sys.executable, "-c", SCRIPT, op], capture_output=True, text=True, env=env, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    peak, outputs = map(int, child.stdout.split())
    from helpers import report

    # the selection holds one group of slots and logits while the two ops it runs hold their own
    chunks = reference.CHUNK_BYTES + (reference.CACHE_TOPK_GROUP_BYTES if op == "index_select" else 0)
    report(request.config, f"reference {op}: peak {peak / 2**20:.0f} MB above its inputs "
                           f"(outputs {outputs / 2**20:.0f} MB, bound {chunks / 2**20:.0f} MB + slack)")
    assert peak <= outputs + chunks + SLACK
