"""The attention layer against an independent, straightforward float64 implementation.

The reference recomputes everything per request from the whole history of layer inputs: the
window keys, each compressed block pooled from its own tokens (no state ring), the indexer's keys,
scores and top-k, then dense attention over the window + selected blocks. It shares no code with
the layer except the weights and the caches' dequantization (``gather_dequant``, tested in
``test_layout.py``; ``gather_index_keys``, in ``test_indexer_cache.py``): the caches the layer wrote are first checked against the reference keys
(within one fp8 step), then the attention reads the dequantized keys, so the output comparison
is tight. Rounding to bf16 happens where the layer's tensors are bf16.

``DSV4_TEST_COMPILE=1`` runs the layer compiled (``conftest.call``).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import call

from dsv4_compile import layout
from helpers import sylvester_hadamard
from test_block import (
    CACHE, CFG, PROMPTS, REQ_SLOTS, STEPS, layer_step, make_layer, prompt_args, second_args, step_args,
)
from test_model_config import yarn_reference

F64 = torch.float64


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16, keep float64."""
    return x.to(torch.bfloat16).to(F64)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.to(F64) @ weight.to(F64).T


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = CFG.rms_norm_eps) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.to(F64)


def frequencies(compressed: bool) -> torch.Tensor:
    """The 32 rotation frequencies of a layer kind, straight from the formulas (float64)."""
    if compressed:
        return yarn_reference(CFG.compress_rope_theta, CFG.rope_factor, CFG.original_max_position_embeddings,
                              CFG.beta_fast, CFG.beta_slow)
    return CFG.rope_theta ** (-2 * torch.arange(32, dtype=F64) / 64)


def rotate(x: torch.Tensor, pos: torch.Tensor, f: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE of the last 64 dims of ``x [n, ..., D]`` at positions ``pos [n]``."""
    x = x.clone()
    angle = pos.to(F64).view(-1, *([1] * (x.dim() - 2)), 1) * f
    c, s = angle.cos(), angle.sin() * (-1 if inverse else 1)
    a, b = x[..., -64::2].clone(), x[..., -63::2].clone()
    x[..., -64::2], x[..., -63::2] = a * c - b * s, a * s + b * c
    return x


def compressed_blocks(comp, wkv_gate, x: torch.Tensor, ratio: int) -> torch.Tensor:
    """Every complete block of one request's inputs ``x [L, hidden]``: pooled, normed (no RoPE)."""
    d = comp.head_dim
    proj = linear(x.float(), wkv_gate.float())
    width = proj.shape[1] // 2
    kv, score = proj[:, :width], proj[:, width:]
    score = score + comp.ape.to(F64)[torch.arange(len(x)) % ratio]
    out = []
    for k in range(len(x) // ratio):
        cur = slice(k * ratio, (k + 1) * ratio)
        if ratio == 4:  # previous block's first halves (none before block 0), this block's second halves
            prev = slice((k - 1) * ratio, k * ratio)
            pk = kv[prev, :d] if k else torch.zeros(ratio, d, dtype=F64)
            ps = score[prev, :d] if k else torch.full((ratio, d), -math.inf, dtype=F64)
            bk, bs = torch.cat([pk, kv[cur, d:]]), torch.cat([ps, score[cur, d:]])
        else:
            bk, bs = kv[cur], score[cur]
        out.append((bk * torch.softmax(bs, dim=0)).sum(0))
    return rmsnorm(torch.stack(out), comp.norm_weight) if out else torch.zeros(0, d, dtype=F64)


def slot(page_table, req: int, entry: int, per_page: int) -> int:
    return page_table[req][entry // per_page] * per_page + entry % per_page


class Reference:
    """Layer math per request, from the full input history."""

    def __init__(self, layer, page_table):
        self.layer, self.pt = layer, page_table.tolist()
        self.f = frequencies(layer.compress_ratio > 0)
        self.ratio = layer.compress_ratio
        self.tied_rows: list[bool] = []  # per output row of a ratio-4 layer, in order: no unique top-k set

    def queries(self, x: torch.Tensor, pos: torch.Tensor):
        a = self.layer
        q_lora = bf16(rmsnorm(bf16(linear(x, a.x_weight("wq_a"))), a.q_norm.weight))
        q = bf16(linear(q_lora, a.wq_b.weight)).view(len(x), a.heads, 512)
        return bf16(rotate(rmsnorm(q, None), pos, self.f)), q_lora

    def window_keys(self, x: torch.Tensor) -> torch.Tensor:
        """Normed, rotated keys of all positions of a request ``[L, 512]``."""
        a = self.layer
        kv = bf16(linear(x, a.x_weight("wkv")))
        return rotate(rmsnorm(kv, a.kv_norm.weight), torch.arange(len(x)), self.f)

    def block_keys(self, x: torch.Tensor) -> torch.Tensor:
        blocks = compressed_blocks(self.layer.compressor, self.layer.x_weight("compressor.wkv_gate"), x, self.ratio)
        return rotate(blocks, torch.arange(len(blocks)) * self.ratio, self.f)

    def index_scores(self, x_new, q_lora, pos, x_all) -> torch.Tensor:
        """Indexer logits ``[n, blocks]`` (``-inf`` where not yet visible)."""
        ix = self.layer.indexer
        h = sylvester_hadamard(ix.head_dim)
        blocks = compressed_blocks(ix.compressor, self.layer.x_weight("indexer.compressor.wkv_gate"), x_all, 4)
        keys = rotate(blocks, torch.arange(len(blocks)) * 4, self.f) @ h
        q = bf16(linear(q_lora, ix.wq_b.weight)).view(len(x_new), ix.heads, ix.head_dim)
        q = rotate(q, pos, self.f) @ h
        w = bf16(linear(x_new, ix.weights_proj.weight)) * ix.head_dim**-0.5 * ix.heads**-0.5
        logits = torch.einsum("nh,nhk->nk", w, torch.einsum("nhd,kd->nhk", q, keys).relu())
        visible = torch.arange(len(blocks))[None] < ((pos + 1) // 4)[:, None]
        return logits.masked_fill(~visible, -math.inf)

    def selected_blocks(self, x_new, q_lora, pos, x_all) -> list[list[int]]:
        """The top-k blocks per query. A row whose k-th and (k+1)-th logits tie (e.g. at 0, where
        every head's ReLU is 0) has no unique top-k set; such rows are listed in ``tied_rows``."""
        n_visible = ((pos + 1) // self.ratio).tolist()
        if self.ratio == 128:
            return [list(range(n)) for n in n_visible]
        logits = self.index_scores(x_new, q_lora, pos, x_all)
        k, selected = CFG.index_topk, []
        for i, n in enumerate(n_visible):
            if n <= k:
                selected.append(list(range(n)))
                self.tied_rows.append(False)
                continue
            top = logits[i].topk(k + 1)
            selected.append(top.indices[:k].tolist())
            self.tied_rows.append(bool(top.values[k - 1] - top.values[k] <= 1e-9 * top.values[k - 1].abs()))
        return selected

    def output(self, x_all: torch.Tensor, start: int, req: int) -> torch.Tensor:
        """The layer output for positions ``start..`` of request ``req`` with inputs ``x_all``."""
        a = self.layer
        x_new = x_all[start:]
        pos = torch.arange(start, len(x_all))
        q, q_lora = self.queries(x_new, pos)
        blocks = self.selected_blocks(x_new, q_lora, pos, x_all) if self.ratio else None
        def keys_at(cache, page, entries):  # dequantized keys of request `req`'s entries
            slots = torch.tensor([slot(self.pt, req, e, page) for e in entries], dtype=torch.long)
            return layout.gather_dequant(cache, page, slots, F64)

        rows = []
        for i, p in enumerate(pos.tolist()):
            window = range(max(0, p - CFG.sliding_window + 1), p + 1)
            keys = keys_at(a.swa_cache, CACHE.page_size, window)
            if blocks is not None and blocks[i]:
                keys = torch.cat([keys, keys_at(a.compressed_cache, a.compressed_page_size, blocks[i])])
            s = q[i] @ keys.T * 512**-0.5  # [H, K]
            lse = torch.logsumexp(s, -1, keepdim=True)
            o = torch.softmax(s, -1) @ keys / (1 + torch.exp(a.attn_sink.to(F64)[:, None] - lse))
            rows.append(o)
        o = bf16(torch.stack(rows))
        o = bf16(rotate(o, pos, self.f, inverse=True)).view(len(pos), a.groups, -1)
        wo_a = a.wo_a.weight.to(F64).view(a.groups, a.o_lora_rank, -1)
        o = bf16(torch.einsum("tgd,grd->tgr", o, wo_a))
        return bf16(linear(o.flatten(1), a.wo_b.weight))


def request_history(*args_list) -> list[torch.Tensor]:
    """Per batch row: the concatenated inputs of the steps."""
    history = [[] for _ in PROMPTS]
    for args in args_list:
        for b in range(len(PROMPTS)):
            history[b].append(args["x"][args["batch_index"] == b])
    return [torch.cat(h) for h in history]


#: The output comparison scores with the exact indexer (float32 keys and queries): the reference's
#: float64 selection is then that of the layer but at near-ties (``tied_rows``). The quantized
#: indexer caches are held to the reference keys below, their selections in test_indexer_formats.py.
EXACT_INDEX = dataclasses.replace(CACHE, index_format="fp32")


def run_layer(ratio, step, cache=EXACT_INDEX):
    layer = make_layer(ratio, cache=cache)
    first, second = prompt_args(), second_args(step)
    with torch.no_grad():
        call(layer_step, layer, **first)
        out = call(layer_step, layer, **second)
    return layer, first, second, out


def assert_holds_keys(cache, page, pt, req, want, where) -> None:
    """Entries ``0 .. len(want)-1`` of request ``req`` in ``cache`` hold the keys ``want``: one
    fp8 step on dims 0..447; on the bf16 RoPE dims 2^-6 relative (the layer's bf16 roundings
    before and after the rotation reach ~2^-7.8 here)."""
    slots = torch.tensor([slot(pt, req, j, page) for j in range(len(want))], dtype=torch.long)
    got = layout.gather_dequant(cache, page, slots, F64)
    err, fp8, rope = (got - want).abs(), slice(0, 448), slice(448, None)
    amax = want[:, fp8].abs().amax(-1, keepdim=True)
    assert (err[:, fp8] <= 2**-4 * want[:, fp8].abs() + 2**-8 * amax + 1e-3).all(), where
    assert (err[:, rope] <= 2**-6 * want[:, rope].abs() + 1e-4).all(), where


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_caches_hold_the_reference_keys(ratio, step):
    """Window and compressed caches, at the slots the page table gives, hold the reference keys
    (one fp8 step on dims 0..447, bf16 on the RoPE dims)."""
    layer, first, second, _ = run_layer(ratio, step)
    ref = Reference(layer, first["page_table"])
    for b, (req, x) in enumerate(zip(REQ_SLOTS, request_history(first, second))):
        caches = [(layer.swa_cache, CACHE.page_size, ref.window_keys(x))]
        if ratio:
            caches.append((layer.compressed_cache, layer.compressed_page_size, ref.block_keys(x)))
        for cache, page, want in caches:
            assert_holds_keys(cache, page, ref.pt, req, want, (b, page))


@pytest.mark.parametrize("index_format", list(layout.INDEX_FORMATS))
@pytest.mark.parametrize("step", sorted(STEPS))
def test_indexer_cache_holds_the_reference_keys(step, index_format):
    """The indexer's key cache holds the reference keys: float32 ones within float32 noise; FP8 /
    FP4 ones Hadamard-rotated, within one rounding step of their format (per key ``2^-3 |k|`` and
    a subnormal step of ``amax / 448``; per 32 values ``|k| / 2`` and ``amax / 6``)."""
    cache = dataclasses.replace(CACHE, index_format=index_format)
    layer, first, second, _ = run_layer(4, step, cache)
    ref = Reference(layer, first["page_table"])
    ix = layer.indexer
    for req, x in zip(REQ_SLOTS, request_history(first, second)):
        keys = compressed_blocks(ix.compressor, layer.x_weight("indexer.compressor.wkv_gate"), x, 4)
        keys = rotate(keys, torch.arange(len(keys)) * 4, ref.f)
        slots = torch.tensor([slot(ref.pt, req, k, ix.page_size) for k in range(len(keys))], dtype=torch.long)
        got = layout.gather_index_keys(ix.key_cache, ix.page_size, slots, index_format).to(F64)
        if index_format == "fp32":
            torch.testing.assert_close(got, keys, atol=1e-4, rtol=1e-4)
            continue
        want = keys @ sylvester_hadamard(ix.head_dim)
        if index_format == "fp8":
            bound = 2**-3 * want.abs() + want.abs().amax(-1, keepdim=True) / 448 * 2**-9
        else:
            amax = want.abs().unflatten(-1, (4, 32)).amax(-1, keepdim=True).expand(-1, -1, 32).flatten(-2)
            bound = want.abs() / 2 + amax / 6
        assert bool(((got - want).abs() <= bound + 1e-4).all()), (req, index_format)


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_output_matches_reference(ratio, step):
    layer, first, second, out = run_layer(ratio, step)
    ref = Reference(layer, first["page_table"])
    history = request_history(first, second)
    want = torch.cat([ref.output(x, start, req) for req, x, start in zip(REQ_SLOTS, history, PROMPTS)])
    # rows of `out` follow the batch order of `second`, which is request by request; the reference
    # rounds to bf16 where the layer does, so they differ by a bf16 ulp or two (a rounding flip).
    # A row whose top-k set is not unique (tied logits at the boundary) may select either block.
    unique = ~torch.tensor(ref.tied_rows, dtype=torch.bool) if ratio == 4 else torch.ones(len(want), dtype=torch.bool)
    assert unique.float().mean() > 0.9, "the comparison must cover nearly every row"
    torch.testing.assert_close(out.to(F64)[unique], want[unique], atol=2**-7 * want.abs().max().item(), rtol=2**-7)


def test_decode_completes_a_compressed_block_from_the_running_state():
    """A ratio-128 block finished by a one-token decode step: its other 127 tokens came in a
    prefill, an extend step and five decode steps, and reach the latent through the compressor's
    running state. The cache holds the reference keys."""
    layer = make_layer(128)
    extend = (1, 1, 100)  # batch row 2: positions 150..249
    steps = [prompt_args(), step_args(extend, PROMPTS, "decode", seed=2)]
    starts = [p + n for p, n in zip(PROMPTS, extend)]
    steps += [step_args((1, 1, 1), [s + i for s in starts], "decode", seed=3 + i) for i in range(6)]
    with torch.no_grad():
        for args in steps:
            call(layer_step, layer, **args)
    ref = Reference(layer, steps[0]["page_table"])
    for b, (req, x) in enumerate(zip(REQ_SLOTS, request_history(*steps))):
        want = ref.block_keys(x)
        assert len(want) == (2 if b == 2 else 0)  # row 2: block 1 ends at position 255, the last step
        assert_holds_keys(layer.compressed_cache, layer.compressed_page_size, ref.pt, req, want, b)


def test_topk_selection_is_exercised():
    """The ratio-4 case selects among more visible blocks than index_topk (not just 'all')."""
    assert max(PROMPTS) // 4 > CFG.index_topk


@pytest.mark.cuda
def test_compressor_projection_on_cuda_is_the_float32_gemm():
    """The compressor's CUDA projection (a bf16 GEMM accumulating in float32) equals the float64
    product of the same bf16 values within float32 accumulation error, as the float32 GEMM does."""
    from dsv4_compile.models.linear import linear_fp32

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=gen).to(torch.bfloat16)
    w = (torch.randn(2048, 4096, generator=gen) * 4096**-0.5).to(torch.bfloat16)
    want = x.to(F64) @ w.to(F64).T
    bound = 4096 * 2**-23 * (x.to(F64).abs() @ w.to(F64).abs().T)  # K * eps32 * sum |x w|
    got = linear_fp32(x.cuda(), w.cuda())
    assert got.dtype == torch.float32 and got.shape == (64, 2048)
    assert ((got.cpu().to(F64) - want).abs() <= bound).all()
    fp32 = torch.nn.functional.linear(x.cuda().float(), w.cuda().float())
    assert ((fp32.cpu().to(F64) - want).abs() <= bound).all()


@pytest.mark.cuda
def test_stacked_projection_on_cuda_is_the_bf16_and_float32_gemms():
    """``linear_split`` on CUDA (one GEMM with a float32 output): its first rows equal the bf16
    linear (float32 accumulation, one rounding to bf16), the others the float32 GEMM, within
    float32 accumulation error (and, for the bf16 part, bf16's unit roundoff)."""
    from dsv4_compile.models.linear import linear_split

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=gen).to(torch.bfloat16)
    w = (torch.randn(1536 + 2048, 4096, generator=gen) * 4096**-0.5).to(torch.bfloat16)
    want = x.to(F64) @ w.to(F64).T
    bound = 4096 * 2**-23 * (x.to(F64).abs() @ w.to(F64).abs().T)
    out, out_fp32 = linear_split(x.cuda(), w.cuda(), 1536)
    assert (out.dtype, out.shape, out_fp32.dtype, out_fp32.shape) == (
        torch.bfloat16, (64, 1536), torch.float32, (64, 2048))
    assert ((out.cpu().to(F64) - want[:, :1536]).abs() <= bound[:, :1536] + 2**-8 * want[:, :1536].abs()).all()
    assert ((out_fp32.cpu().to(F64) - want[:, 1536:]).abs() <= bound[:, 1536:]).all()
