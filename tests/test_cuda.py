"""GPU tests (marked ``cuda``): the CUDA providers against the reference on the same GPU tensors,
against the raw FlashMLA library, under opcheck, CUDA graphs and torch.compile.

Max errors are appended as JSON lines to ``$DSV4_RESULTS`` when set (for benchmarks/RESULTS.md).
"""

import contextlib
import json
import math
import os

import pytest
import torch

import dsv4_compile as d4
from dsv4_compile import dispatch
from dsv4_compile.tolerances import DEVICE

from helpers import assert_malformed_calls_named

pytestmark = pytest.mark.cuda
DEV = "cuda"


def record(**row):
    path = os.environ.get("DSV4_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def filled(num_pages, page_size, stride=None):
    cache = d4.alloc_cache(num_pages, page_size, DEV, page_stride=stride)
    n = num_pages * page_size
    kv = torch.randn(n, 512, dtype=torch.bfloat16, device=DEV) * 2
    freqs = torch.randn(n, 64, device=DEV)
    with d4.use_provider("reference"):
        d4.fused_k_norm_rope_flashmla(kv, torch.ones(512, dtype=torch.bfloat16, device=DEV), freqs,
                                      torch.arange(n, device=DEV), torch.arange(n, device=DEV), cache, 1e-6, page_size)
    return cache


def indices(shape, cap, holes=0.1):
    idx = torch.randint(0, cap, shape, dtype=torch.int32, device=DEV)
    return torch.where(torch.rand(shape, device=DEV) < holes, -1, idx).to(torch.int32)


def sink_of(kind, heads):
    return None if kind == "none" else {
        "random": torch.randn(heads, device=DEV),
        "+inf": torch.full((heads,), math.inf, device=DEV),
        "-inf": torch.full((heads,), -math.inf, device=DEV),
    }[kind]


def compare(name, got, want, vmax=1.0, **case):
    tol = DEVICE[name]
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: non-finite pattern differs"
    assert torch.equal(got[~finite], want[~finite])
    err = (got.float() - want.float())[finite].abs().max().item() if finite.any() else 0.0
    record(op=name, err=err, **case)
    scale = vmax if name == "out" else 1.0
    torch.testing.assert_close(got.float(), want.float(), atol=tol.atol * scale, rtol=tol.rtol, equal_nan=True)


def test_providers_on_this_gpu():
    chosen = d4.providers(DEV)
    record(providers=chosen, device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()))
    registered = set(dispatch.registered_providers("cuda"))
    assert set(chosen) == set(dispatch.OPS) and set(chosen.values()) <= registered, chosen
    assert chosen["fused_k_norm_rope_flashmla"] in ("triton", "reference"), chosen
    if torch.cuda.get_device_capability() == (9, 0) or torch.cuda.get_device_capability()[0] == 10:
        assert chosen["flash_mla_with_kvcache"] in ("flashmla", "sgl_kernel"), chosen


@pytest.mark.parametrize("heads", [64, 128, 16])
@pytest.mark.parametrize("page_size", [2, 64, 128, 256])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("sink_kind", ["random", "none", "+inf", "-inf"])
def test_decode_vs_reference(heads, page_size, extra, sink_kind):
    torch.manual_seed(page_size + heads)
    batch, s_q = 8, (2 if heads == 128 else 1)
    cache = filled(max(4, 1024 // page_size), page_size)
    cap = cache.shape[0] * page_size
    idx = indices((batch, s_q, 128), cap)
    idx[0] = -1  # an empty row (when no extra key either)
    lengths = torch.randint(0, 129, (batch,), dtype=torch.int32, device=DEV)
    ecache = eidx = elen = None
    if extra:
        ecache = filled(64, 2)
        eidx = indices((batch, s_q, 200), 128)
        elen = torch.randint(0, 201, (batch,), dtype=torch.int32, device=DEV)
        elen[0] = 0
    q = torch.randn(batch, s_q, heads, 512, dtype=torch.bfloat16, device=DEV)
    args = (q, cache, page_size, idx, lengths, sink_of(sink_kind, heads), ecache, 2, eidx, elen, None, None, 512**-0.5, 512)
    out, lse = torch.ops.dsv4.flash_mla_with_kvcache(*args)
    with d4.use_provider("reference"):
        want_out, want_lse = torch.ops.dsv4.flash_mla_with_kvcache(*args)
    case = dict(kind="decode", heads=heads, page_size=page_size, extra=extra, sink=sink_kind)
    vmax = d4.gather_dequant(cache, page_size, torch.arange(cap, device=DEV), torch.float32).abs().max().item()
    compare("out", out, want_out, vmax, **case)
    compare("lse", lse, want_lse, **case)
    assert torch.isposinf(lse[0]).all() and not out[0].any()


@pytest.mark.parametrize("heads,topk", [(64, 640), (128, 512), (64, 100), (16, 256)])
@pytest.mark.parametrize("sink_kind", ["random", "none"])
def test_prefill_vs_reference(heads, topk, sink_kind):
    torch.manual_seed(topk)
    s_q, s_kv = 256, 4096
    q = torch.randn(s_q, heads, 512, dtype=torch.bfloat16, device=DEV)
    kv = torch.randn(s_kv, 1, 512, dtype=torch.bfloat16, device=DEV)
    idx = torch.randint(-1, s_kv + 8, (s_q, 1, topk), dtype=torch.int32, device=DEV)
    lengths = torch.randint(0, topk + 1, (s_q,), dtype=torch.int32, device=DEV)
    lengths[0] = 0
    args = (q, kv, idx, 512**-0.5, 512, sink_of(sink_kind, heads), lengths)
    got = torch.ops.dsv4.flash_mla_sparse_fwd(*args)
    with d4.use_provider("reference"):
        want = torch.ops.dsv4.flash_mla_sparse_fwd(*args)
    case = dict(kind="prefill", heads=heads, topk=topk, sink=sink_kind)
    compare("out", got[0], want[0], kv.abs().max().item(), **case)
    compare("max_logits", got[1], want[1], **case)
    compare("lse", got[2], want[2], **case)


def decode_step_inputs(batch=64, heads=64):
    cache, ecache = filled(8, 256), filled(256, 2)  # SWA 128 + c128-style extra 512
    q = torch.randn(batch, 1, heads, 512, dtype=torch.bfloat16, device=DEV)
    idx = indices((batch, 1, 128), 8 * 256, holes=0.0)
    eidx = indices((batch, 1, 512), 512, holes=0.0)
    lengths = torch.randint(1, 129, (batch,), dtype=torch.int32, device=DEV)
    elen = torch.randint(0, 513, (batch,), dtype=torch.int32, device=DEV)
    sink = torch.randn(heads, device=DEV)
    return q, cache, idx, lengths, sink, ecache, eidx, elen


def test_hoisted_metadata_is_bit_identical():
    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_step_inputs()
    meta, splits = d4.get_mla_metadata(q, idx, lengths, eidx, elen)
    inside = d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 2, eidx, elen)
    hoisted = d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 2, eidx, elen, meta, splits)
    assert torch.equal(inside[0], hoisted[0]) and torch.equal(inside[1], hoisted[1])
    fake_meta, fake_splits = dispatch.metadata_shapes(q.device, q.shape[0], 1, 64)
    assert meta.shape == fake_meta and splits.shape == fake_splits
    # stale metadata: detected in checked mode
    new_lengths = torch.clamp(lengths - 64, min=0).to(torch.int32)
    with d4.checked(), pytest.raises(ValueError, match="stale"):
        d4.flash_mla_with_kvcache(q, cache, 256, idx, new_lengths, sink, ecache, 2, eidx, elen, meta, splits)


def test_equals_raw_flash_mla():
    flash_mla = pytest.importorskip("flash_mla")
    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_step_inputs()
    sched, _ = flash_mla.get_mla_metadata()
    raw_out, raw_lse = flash_mla.flash_mla_with_kvcache(
        q, d4.flashmla_view(cache, 256), None, None, 512, sched, softmax_scale=512**-0.5, is_fp8_kvcache=True,
        indices=idx, attn_sink=sink, extra_k_cache=d4.flashmla_view(ecache, 2), extra_indices_in_kvcache=eidx,
        topk_length=lengths, extra_topk_length=elen, use_legacy=True,
    )
    out, lse = d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 2, eidx, elen)
    record(kind="raw_decode_bit_identical", out=torch.equal(out, raw_out), lse=torch.equal(lse, raw_lse))
    assert torch.equal(out, raw_out) and torch.equal(lse, raw_lse)
    s_q, s_kv = 512, 4096
    pq = torch.randn(s_q, 64, 512, dtype=torch.bfloat16, device=DEV)
    pkv = torch.randn(s_kv, 1, 512, dtype=torch.bfloat16, device=DEV)
    pidx = torch.randint(0, s_kv, (s_q, 1, 640), dtype=torch.int32, device=DEV)
    raw = flash_mla.flash_mla_sparse_fwd(pq, pkv, pidx, 0.05, 512, sink, None, use_legacy=True)
    ours = d4.flash_mla_sparse_fwd(pq, pkv, pidx, 0.05, attn_sink=sink)
    same = [torch.equal(a, b) for a, b in zip(ours, raw)]
    record(kind="raw_prefill_bit_identical", out_max_logits_lse=same)
    assert all(same)


def test_opcheck_on_cuda():
    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_step_inputs(batch=4)
    torch.library.opcheck(torch.ops.dsv4.flash_mla_with_kvcache.default,
                          (q, cache, 256, idx, lengths, sink, ecache, 2, eidx, elen, None, None, 0.05, 512))
    meta = torch.ops.dsv4.get_mla_metadata.default(q, idx, lengths, eidx, elen)
    torch.library.opcheck(torch.ops.dsv4.flash_mla_with_kvcache.default,
                          (q, cache, 256, idx, lengths, sink, ecache, 2, eidx, elen, *meta, 0.05, 512))
    torch.library.opcheck(torch.ops.dsv4.get_mla_metadata.default, (q, idx, lengths, eidx, elen))
    pq = torch.randn(64, 64, 512, dtype=torch.bfloat16, device=DEV)
    pkv = torch.randn(300, 1, 512, dtype=torch.bfloat16, device=DEV)
    pidx = torch.randint(-1, 310, (64, 1, 100), dtype=torch.int32, device=DEV)
    torch.library.opcheck(torch.ops.dsv4.flash_mla_sparse_fwd.default, (pq, pkv, pidx, 0.05, 512, sink, None))


def test_cuda_graph_replay_follows_length_changes():
    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_step_inputs(batch=8)

    def step():
        meta, splits = d4.get_mla_metadata(q, idx, lengths, eidx, elen)
        return d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 2, eidx, elen, meta, splits)

    step()  # warm up (lazy resolution, first launches)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for _ in range(3):
        lengths.copy_(torch.randint(0, 129, lengths.shape, dtype=torch.int32, device=DEV))
        elen.copy_(torch.randint(0, 513, elen.shape, dtype=torch.int32, device=DEV))
        graph.replay()
        want = step()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


class DecodeLayer(torch.nn.Module):
    def __init__(self, cache, ecache):
        super().__init__()
        self.register_buffer("cache", cache)
        self.register_buffer("ecache", ecache)

    def forward(self, q, idx, lengths, sink, eidx, elen):
        meta, splits = d4.get_mla_metadata(q, idx, lengths, eidx, elen)
        out, lse = d4.flash_mla_with_kvcache(q, self.cache, 256, idx, lengths, sink, self.ecache, 2, eidx, elen, meta, splits)
        return out.float() * 2, lse


def test_compile_and_reduce_overhead():
    from torch._dynamo.utils import counters

    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_step_inputs(batch=8)
    layer = DecodeLayer(cache, ecache)
    explanation = torch._dynamo.explain(layer)(q, idx, lengths, sink, eidx, elen)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    counters.clear()
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        want = layer(q, idx, lengths, sink, eidx, elen)
        for _ in range(3):
            got = compiled(q, idx, lengths, sink, eidx, elen)
    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
    record(kind="reduce_overhead_decode", cudagraph_skips=skips)
    assert skips == 0
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("provider", ["default", "reference"])
@pytest.mark.parametrize("byte", [0x7F, 0xFF], ids=hex)
@pytest.mark.parametrize("heads", [64, 16])
def test_outputs_read_nothing_their_row_does_not_reference(provider, byte, heads):
    """Garbage (NaN/Inf byte patterns) in every unreferenced cache byte and workspace row: the
    outputs are bit-identical to those over clean memory, on the GPU providers and the reference."""
    from helpers import (decode_args_around_garbage, poisoned_decode_args, poisoned_prefill_args,
                         prefill_args_around_garbage)

    torch.manual_seed(0)
    decode = decode_args_around_garbage(heads=heads, device=DEV, width=200)
    prefill = prefill_args_around_garbage(heads=heads, device=DEV)
    with d4.use_provider(provider) if provider == "reference" else contextlib.nullcontext():
        for op, args, poisoned in ((torch.ops.dsv4.flash_mla_with_kvcache.default, decode, poisoned_decode_args),
                                   (torch.ops.dsv4.flash_mla_sparse_fwd.default, prefill, poisoned_prefill_args)):
            clean = op(*args)
            dirty = op(*poisoned(args, byte))
            record(op=f"garbage-{op.name()}", provider=d4.providers(DEV)[op.name().split("::")[1].split(".")[0]],
                   byte=byte, heads=heads, nan_outputs=int(dirty[0].isnan().sum()))
            assert clean[0].isfinite().all()
            assert all(torch.equal(a, b) for a, b in zip(clean, dirty))


@pytest.mark.parametrize("provider", ["default", "reference"])
def test_empty_batches(provider):
    cache = filled(2, 64)
    with d4.use_provider(provider) if provider == "reference" else contextlib.nullcontext():
        for batch, s_q in ((0, 1), (3, 0)):
            q = torch.randn(batch, s_q, 64, 512, dtype=torch.bfloat16, device=DEV)
            idx = torch.zeros(batch, s_q, 64, dtype=torch.int32, device=DEV)
            meta, splits = d4.get_mla_metadata(q, idx)
            out, lse = d4.flash_mla_with_kvcache(q, cache, 64, idx, tile_scheduler_metadata=meta, num_splits=splits)
            assert out.shape == (batch, s_q, 64, 512) and lse.shape == (batch, 64, s_q)
        q = torch.randn(0, 64, 512, dtype=torch.bfloat16, device=DEV)
        out, mx, lse = d4.flash_mla_sparse_fwd(q, torch.randn(4, 1, 512, dtype=torch.bfloat16, device=DEV),
                                               torch.zeros(0, 1, 128, dtype=torch.int32, device=DEV), 0.1)
        assert out.shape == (0, 64, 512)


def test_malformed_calls_get_the_checks_errors_behind_flashmla():
    """The ``flashmla`` provider sends known call signatures at 64 heads to FlashMLA unchecked
    (``Provider.validates``): FlashMLA's own checks must refuse every malformed one, and the
    caller still gets the metadata checks' error naming the argument, through the op and through
    the Python wrappers' direct path alike."""
    if dispatch.resolve("flash_mla_with_kvcache", torch.device(DEV))[0] != "flashmla":
        pytest.skip("FlashMLA's legacy kernels do not serve this GPU")
    ops = {"decode": torch.ops.dsv4.flash_mla_with_kvcache.default, "prefill": torch.ops.dsv4.flash_mla_sparse_fwd.default}
    wrappers = {"decode": d4.flash_mla_with_kvcache, "prefill": d4.flash_mla_sparse_fwd}
    assert_malformed_calls_named(lambda op, *args: ops[op](*args), DEV)
    assert_malformed_calls_named(lambda op, *args: wrappers[op](*args), DEV)
    torch.cuda.synchronize()  # no kernel of a refused call ran into an error
