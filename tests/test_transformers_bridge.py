"""The transformers bridge (:mod:`dsv4_compile.integrations.transformers`): one transformers
``DeepseekV4Attention`` of each layer kind against ours loaded from it.

Their layer runs eagerly in float32 without a cache, as their ``DeepseekV4Model`` calls it on a
prefill: the position embeddings of both RoPE labels from their ``DeepseekV4RotaryEmbedding`` and
the sliding-window causal mask of ``create_sliding_window_causal_mask`` (their modeling file,
``DeepseekV4Model.forward``). Its weights and inputs are bf16 values, so ours (bf16 layer) holds
them exactly. Ours runs one prefill step over the same tokens with ``kv_format="v4"`` (the FP8
window and compressed caches) and ``index_format="fp32"`` (exact indexer keys).

Tolerance: :func:`~dsv4_compile.tolerances.rerounded_atol` (``FP8_STEP_SHARE`` of the largest
output magnitude); far tighter, :func:`~dsv4_compile.tolerances.regrouped_atol`, where their layer
rounds as ours does (:func:`rounded_as_ours`: their keys through our cache codec, their query and
key projections rounded to bf16). The two computations round at other places: theirs keeps every key in float32,
ours stores the keys' 448 non-RoPE dims as FP8 (e4m3: a step is ``2**-3`` of its binade) and
rounds activations to bf16 where the layer is bf16; the attention output, a convex combination
of keys, and the output projections after it move by up to that share of their scale. It is the
project's tolerance for computations that round at other places; the measured errors are 3.6 to
4.6% of the largest magnitude (printed by each case under ``-s``). Being that loose, it would pass
a compressor without its position bias or its norm weight (tried: 4.4% and 10.9%), so the keys
our caches hold are checked against theirs apart, within one FP8 step
(:func:`test_caches_hold_their_keys`), which catches both.

The indexer (ratio 4) picks its top-k blocks from logits that ours computes from bf16-rounded
inputs (``q_lora``, the index query, the head weights) where theirs are float32, and breaks exact
ties (e.g. blocks whose every head's ReLU is 0) to the lower block where ``torch.topk`` picks
any. So the selections are checked apart: they may differ only at near-ties of their logits
(within :data:`NEAR_TIE` of the row's largest logit term sum), and rows whose selections differ
are left out of the output comparison (a different block is a different key, not a rounding).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers")

from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4 import configuration_deepseek_v4 as hf_conf  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_model  # noqa: E402

from dsv4_compile import layout  # noqa: E402
from dsv4_compile.integrations.transformers import (  # noqa: E402
    NAME_MAP,
    attention_from_hf,
    attention_state_from_hf,
    config_from_hf,
    tiny_hf_config,
)
from dsv4_compile.models import CacheConfig, build_step_metadata, prefill_inputs  # noqa: E402
from dsv4_compile.models.metadata import slot_of  # noqa: E402
from dsv4_compile.providers import reference  # noqa: E402
from dsv4_compile.tolerances import FP8_STEP_SHARE, bf16_ulp, regrouped_atol, rerounded_atol  # noqa: E402

KINDS = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
SEQ = 300  # > 2 * 128: two ratio-128 blocks; 75 ratio-4 blocks for a top-8
CACHE = CacheConfig(max_requests=1, max_seq_len=512, page_size=256, kv_format="v4", index_format="fp32")
PAGES = torch.arange(CACHE.num_pages, dtype=torch.int32).view(CACHE.max_requests, CACHE.pages_per_request)
#: a selection difference counts as a near-tie where the differing blocks' logits lie within this
#: share of the row's largest ``sum_h |w_h| sum_d |q_hd k_d|`` (scaled as the logits are) of the
#: k-th logit: our layer rounds four inputs of the logits to bf16 (``wq_a``'s output, ``q_lora``,
#: the index query, the head weights), 2**-9 relative each, which moves a logit by up to about
#: 4 * 2**-9 of that sum (measured: the differing blocks lie within 2**-12 of it)
NEAR_TIE = 2**-7


def hf_config(**overrides) -> hf_conf.DeepseekV4Config:
    """The tests' transformers DSV4 (:func:`tiny_hf_config`: 4 heads of 512, one layer of each
    kind in :data:`KINDS`' order, YaRN over an original context of 256 positions, so the blend
    moves frequencies the test's positions reach)."""
    config = tiny_hf_config(**overrides)
    assert config.layer_types == list(KINDS)
    return config


HF_CONFIG = hf_config()


def hf_attention(kind: str, seed: int = 0, config=HF_CONFIG) -> hf_model.DeepseekV4Attention:
    """Their layer of ``kind`` with seeded bf16-representable float32 weights (linears
    ``N(0, 1/fan_in)``, norm weights ``1 + N(0, 0.1)``, position biases ``N(0, 0.5)``, sinks
    ``N(0, 1)``): their initialisation leaves most parameters empty."""
    attn = hf_model.DeepseekV4Attention(config, list(KINDS).index(kind)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if p.dim() == 2:
                value = torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5
            elif "norm" in name:
                value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("position_bias"):
                value = 0.5 * torch.randn(p.shape, generator=gen)
            else:
                value = torch.randn(p.shape, generator=gen)
            p.copy_(value.to(torch.bfloat16).float())
    return attn


def inputs(seed: int = 1) -> torch.Tensor:
    """The layer inputs ``[SEQ, hidden]``, bf16."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ, HF_CONFIG.hidden_size, generator=gen).to(torch.bfloat16)


def run_hf(attn, x: torch.Tensor, config=HF_CONFIG) -> tuple[torch.Tensor, dict]:
    """Their layer's output ``[SEQ, hidden]`` on a prefill of ``x`` (float32, no cache), as their
    model calls it; and ``{"keys": {"window": [SEQ, 512], "compressed": [blocks, 512], "index":
    [blocks, 128]}}``, the keys their attention and indexer read (as the layer kind has them),
    with, for a ratio-4 layer, ``"picked" [SEQ, k]``, ``"logits" [SEQ, blocks]``, ``"terms"
    [SEQ, blocks]``: their selection, masked logits and each logit's sum of term magnitudes."""
    h = x.float()[None]
    positions = torch.arange(SEQ)[None]
    rotary = hf_model.DeepseekV4RotaryEmbedding(config)
    embeddings = {label: rotary(h, positions, layer_type=label) for label in ("main", "compress")}
    # positional: the cache argument's name changed in transformers 5.25 (past_key_values -> cache)
    mask = create_sliding_window_causal_mask(config, h, None, None, positions)
    seen = {}
    hooks = [attn.kv_norm.register_forward_hook(lambda m, args, out: seen.update(kv=out))]
    if attn.compressor is not None:
        hooks.append(attn.compressor.register_forward_hook(lambda m, args, out: seen.update(compressed=out[0])))
    indexer = getattr(attn.compressor, "indexer", None)
    if indexer is not None:
        scorer = indexer.scorer
        hooks += [
            scorer.register_forward_pre_hook(lambda m, args: seen.update(scorer_args=args)),
            scorer.register_forward_hook(lambda m, args, out: seen.update(logits=out)),
            indexer.register_forward_hook(lambda m, args, out: seen.update(picked=out)),
        ]
    try:
        with torch.no_grad():
            out, _ = attn(h, position_embeddings=embeddings, position_ids=positions, attention_mask=mask)
    finally:
        for hook in hooks:
            hook.remove()
    # the keys their attention reads: the window keys (normed, rotated at their position as
    # their attention does it) and the compressor's blocks; the indexer's keys below
    cos, sin = embeddings[attn.rope_layer_type]
    window = hf_model.apply_rotary_pos_emb(seen["kv"].view(1, SEQ, 1, -1).transpose(1, 2), cos, sin)
    keys = {"window": window[0, 0]}
    if attn.compressor is not None:
        keys["compressed"] = seen["compressed"][0, 0]
    index = {"keys": keys}
    if indexer is not None:
        q, keys_in, hidden = seen["scorer_args"]  # [1, S, H, D], [1, M, D], [1, S, hidden]
        weights = scorer.weights_proj(hidden).float() * scorer.weights_scaling  # [1, S, H]
        magnitude = torch.einsum("bshd,bmd->bshm", q.float().abs(), keys_in.float().abs()) * scorer.softmax_scale
        terms = torch.einsum("bsh,bshm->bsm", weights.abs(), magnitude)[0]
        visible = torch.arange(keys_in.shape[1])[None] < ((torch.arange(SEQ) + 1) // indexer.compress_rate)[:, None]
        logits = seen["logits"][0].masked_fill(~visible, float("-inf"))
        keys["index"] = keys_in[0]
        index.update(picked=seen["picked"][0], logits=logits, terms=terms.masked_fill(~visible, 0.0))
    return out[0], index


def run_ours(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our layer's output ``[SEQ, hidden]`` (float32 of bf16) on one prefill step of ``x`` (one
    request, page-table row 0), and a ratio-4 layer's selected blocks ``[SEQ, k]``."""
    args = prefill_inputs([[0] * SEQ], "cpu")
    ratio = layer.compress_ratio
    meta = build_step_metadata(
        args["positions"], args["batch_index"], args["seq_lens"], args["req_slots"], PAGES,
        cache=CACHE, window=HF_CONFIG.sliding_window, ratios=(ratio,) if ratio else (), mode="prefill",
    )
    seen = {}
    hook = layer.indexer.register_forward_hook(lambda m, a, out: seen.update(picked=out[0])) if layer.indexer else None
    try:
        with torch.no_grad():
            out = layer(x, meta).float()
    finally:
        if hook is not None:
            hook.remove()
    return out, seen.get("picked")


def selection_differences(index: dict, ours: torch.Tensor) -> torch.Tensor:
    """``[SEQ]`` bool: rows whose selected block sets differ. Asserts that each differing block
    lies at a near-tie of their logits (within ``NEAR_TIE`` of the row's largest term sum of the
    k-th largest logit)."""
    theirs, logits, terms = index["picked"], index["logits"], index["terms"]
    k = theirs.shape[1]
    differ = torch.zeros(SEQ, dtype=torch.bool)
    for t in range(SEQ):
        a, b = set(theirs[t][theirs[t] >= 0].tolist()), set(ours[t][ours[t] >= 0].tolist())
        if a == b:
            continue
        differ[t] = True
        kth = logits[t].topk(k).values[-1]
        margin = NEAR_TIE * terms[t].max()
        off = {m: (logits[t, m] - kth).item() for m in a ^ b if (logits[t, m] - kth).abs() > margin}
        assert not off, (f"row {t}: blocks {sorted(a - b)} (theirs) / {sorted(b - a)} (ours) differ "
                         f"beyond a near-tie: {off}")
    return differ


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_matches_transformers(kind):
    attn = hf_attention(kind)
    layer = attention_from_hf(attn, HF_CONFIG, cache=CACHE)
    assert layer.compress_ratio == KINDS[kind]
    x = inputs()
    want, index = run_hf(attn, x)
    got, picked = run_ours(layer, x)
    rows = torch.ones(SEQ, dtype=torch.bool)
    if layer.compress_ratio == 4:
        rows = ~selection_differences(index, picked)
        assert int(rows.sum()) >= 0.9 * SEQ, f"{int((~rows).sum())} of {SEQ} rows select other blocks"
    atol = rerounded_atol(want)
    err = (got - want).abs()[rows]
    print(f"{kind}: max |err| {err.max().item():.4g} = {err.max().item() / want.abs().max().item():.4f} "
          f"of max |out| {want.abs().max().item():.4g}; atol {atol:.4g}; rows compared {int(rows.sum())}")
    torch.testing.assert_close(got[rows], want[rows], atol=atol, rtol=0.0)


#: their modules whose outputs our layer holds in bf16 on the way to the query and the keys
BF16_OUTPUTS = ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj")


def v4_codec(values: torch.Tensor) -> torch.Tensor:
    """``values [..., 512]`` through the V4 cache format: encoded as our stores encode a key
    (``reference.encode_tokens``, the format's specification) and decoded."""
    flat = values.reshape(-1, layout.HEAD_DIM).float()
    data, scales = reference.encode_tokens(flat, layout.V4)
    return layout.dequant_records(data, scales, layout.V4).view(values.shape).to(values.dtype)


@contextlib.contextmanager
def rounded_as_ours(attn, codec: bool = True):
    """Their layer rounding where ours does: the outputs of :data:`BF16_OUTPUTS` rounded to bf16
    and, with ``codec``, the keys their attention reads passed through our V4 format: the window
    keys' FP8 dims before their rotation (it touches only the RoPE dims) and their RoPE dims
    rounded to bf16, the compressor's blocks whole."""
    def window_keys(module, args, out):
        return torch.cat([v4_codec(out)[..., : layout.NOPE_DIM], out[..., layout.NOPE_DIM :].bfloat16().float()], -1)

    hooks = [attn.get_submodule(name).register_forward_hook(lambda m, a, out: out.bfloat16().float())
             for name in BF16_OUTPUTS]
    if codec:
        hooks.append(attn.kv_norm.register_forward_hook(window_keys))
        if attn.compressor is not None:
            hooks.append(attn.compressor.register_forward_hook(lambda m, a, out: (v4_codec(out[0]), *out[1:])))
    try:
        yield attn
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_matches_transformers_rounded_as_ours(kind):
    """Their layer rounding where ours does (:func:`rounded_as_ours`) against ours, within
    ``regrouped_atol`` (``REGROUPED_ULPS`` bf16 ulps of the largest magnitude): the same roundings
    with sums in other orders, and a key value whose inputs so differ may land across an FP8
    rounding boundary. Measured: at most 0.82 ulps (0.3 to 0.5% of the largest magnitude,
    against 3.6 to 4.6% without); without the codec (the bf16 roundings alone) it errs by 7.9 to
    8.3 ulps: the last assertion checks that it errs by more, so the comparison sees the cache's
    quantization."""
    attn = hf_attention(kind)
    layer = attention_from_hf(attn, HF_CONFIG, cache=CACHE)
    x = inputs()
    got, picked = run_ours(layer, x)
    errors = {}
    for codec in (True, False):
        with rounded_as_ours(attn, codec=codec):
            want, index = run_hf(attn, x)
        rows = torch.ones(SEQ, dtype=torch.bool)
        if layer.compress_ratio == 4:
            rows = ~selection_differences(index, picked)
            assert int(rows.sum()) >= 0.9 * SEQ, f"{int((~rows).sum())} of {SEQ} rows select other blocks"
        errors[codec] = (got - want).abs()[rows].max().item() / bf16_ulp(want.abs().max().item())
        if codec:
            torch.testing.assert_close(got[rows], want[rows], atol=regrouped_atol(want), rtol=0.0)
    print(f"{kind}: max |err| {errors[True]:.3g} bf16 ulps of max |out| with the codec, {errors[False]:.3g} without")
    assert errors[False] > 2 * errors[True], errors


def assert_holds_keys(cache: torch.Tensor, page_size: int, want: torch.Tensor, what: str) -> None:
    """Entries ``0 .. len(want)-1`` of request 0 in a V4 cache hold ``want`` (their float32 keys):
    dims 0..447 (FP8) within one FP8 step, ``FP8_STEP_SHARE * |want|`` (our inputs to the
    rounding differ from theirs by bf16 roundings, so a value near a rounding boundary can land a
    step away), plus ``2**-8`` of the token's largest magnitude for the tiny values under a tile's
    scale; the RoPE dims 448..511 (bf16) within ``2**-6`` of their pair's magnitude: ours rounds
    the key to bf16 three times (the projection, the normed key before the rotation, the stored
    value), ``2**-9`` each (measured: ``2**-7.2``)."""
    slots = slot_of(PAGES, torch.tensor(0), torch.arange(len(want)), page_size)
    got = layout.gather_dequant(cache, page_size, slots, torch.float32, kv_format=CACHE.kv_format)
    err, fp8, rope = (got - want).abs(), slice(0, layout.NOPE_DIM), slice(layout.NOPE_DIM, None)
    amax = want[:, fp8].abs().amax(-1, keepdim=True)
    bad = err[:, fp8] > FP8_STEP_SHARE * want[:, fp8].abs() + 2**-8 * amax
    assert not bool(bad.any()), f"{what}: FP8 dims (token, dim) {bad.nonzero()[:5].tolist()} beyond one FP8 step"
    pairs = want[:, rope].unflatten(-1, (-1, 2)).norm(dim=-1).repeat_interleave(2, dim=-1)
    bad = err[:, rope] > 2**-6 * pairs
    assert not bool(bad.any()), f"{what}: RoPE dims (token, dim) {bad.nonzero()[:5].tolist()} beyond 2**-6"


@pytest.mark.parametrize("kind", list(KINDS))
def test_caches_hold_their_keys(kind):
    """After the prefill our caches hold the keys their attention reads: the window keys, the
    compressor's blocks (pooled, normed, rotated at the block's first position) and, ratio 4, the
    indexer's blocks (float32 format: exact up to float32 summation order). Tighter than the
    output comparison, whose FP8-step tolerance would pass e.g. a compressor without its
    position bias."""
    attn = hf_attention(kind)
    layer = attention_from_hf(attn, HF_CONFIG, cache=CACHE)
    x = inputs()
    _, index = run_hf(attn, x)
    run_ours(layer, x)
    keys = index["keys"]
    assert len(keys["window"]) == SEQ
    assert_holds_keys(layer.swa_cache, layer.page_size, keys["window"], "window")
    if layer.compressor is not None:
        assert len(keys["compressed"]) == SEQ // layer.compress_ratio
        assert_holds_keys(layer.compressed_cache, layer.compressed_page_size, keys["compressed"], "compressed")
    if layer.indexer is not None:
        ix = layer.indexer
        slots = slot_of(PAGES, torch.tensor(0), torch.arange(len(keys["index"])), ix.page_size)
        got = layout.gather_index_keys(ix.key_cache, ix.page_size, slots, ix.format)
        torch.testing.assert_close(got, keys["index"])


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_covers_every_parameter(kind):
    """Every one of our parameters from theirs, cast: ``x_proj``'s rows by the layer's own names."""
    attn = hf_attention(kind)
    layer = attention_from_hf(attn, HF_CONFIG, cache=CACHE)
    state = attention_state_from_hf(attn)  # the meta-device layout
    assert set(state) == {name for name, _ in layer.named_parameters()}
    for name, p in layer.named_parameters():
        assert state[name].shape == p.shape and state[name].dtype == p.dtype, name
        assert torch.equal(state[name], p.detach()), name
    theirs = attn.state_dict()
    assert set(theirs) <= set(NAME_MAP)
    assert torch.equal(layer.x_weight("wq_a").float(), theirs["q_a_proj.weight"])
    assert torch.equal(layer.x_weight("wkv").float(), theirs["kv_proj.weight"])
    if layer.compressor is not None:
        kv, gate = layer.x_weight("compressor.wkv_gate").float().chunk(2)
        assert torch.equal(kv, theirs["compressor.kv_proj.weight"])
        assert torch.equal(gate, theirs["compressor.gate_proj.weight"])
    if layer.indexer is not None:
        kv, gate = layer.x_weight("indexer.compressor.wkv_gate").float().chunk(2)
        assert torch.equal(kv, theirs["compressor.indexer.kv_proj.weight"])
        assert torch.equal(gate, theirs["compressor.indexer.gate_proj.weight"])


def test_missing_parameter_is_named():
    attn = hf_attention("compressed_sparse_attention")
    attn.compressor.indexer.position_bias = None  # dropped from the state dict
    with pytest.raises(ValueError, match=r"missing transformers parameter 'compressor\.indexer\.position_bias'"):
        attention_state_from_hf(attn)


def test_misshaped_parameter_is_named():
    attn = hf_attention("heavily_compressed_attention")
    attn.o_b_proj.weight = torch.nn.Parameter(torch.zeros(128, 64))
    with pytest.raises(ValueError, match=r"'o_b_proj\.weight'.*expected \(128, 128\), got \(128, 64\)"):
        attention_from_hf(attn, HF_CONFIG, cache=CACHE)


def test_unused_parameter_is_named():
    attn = hf_attention("sliding_attention")
    attn.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match=r"unused transformers parameter 'extra'"):
        attention_state_from_hf(attn)


def test_kind_mismatch_names_every_parameter():
    """A ratio-128 layer loaded into a ratio-4 one: the indexer's parameters are missing, the
    compressor's are mis-shaped (ratio 4's are twice as wide)."""
    attn = hf_attention("heavily_compressed_attention")
    target = attention_from_hf(hf_attention("compressed_sparse_attention"), HF_CONFIG, cache=CACHE)
    with pytest.raises(ValueError) as info:
        attention_state_from_hf(attn, target)
    message = str(info.value)
    assert "missing transformers parameter 'compressor.indexer.q_b_proj.weight'" in message
    assert "'compressor.kv_proj.weight'" in message and "expected (1024, 128), got (512, 128)" in message
    assert "dsv4_compile parameter 'indexer.wq_b.weight' not filled" in message


def test_config_round_trips_the_dims():
    ours = config_from_hf(HF_CONFIG)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "o_lora_rank",
                 "o_groups", "head_dim", "qk_rope_head_dim", "sliding_window", "index_n_heads",
                 "index_head_dim", "index_topk", "max_position_embeddings", "rms_norm_eps", "vocab_size"):
        assert getattr(ours, name) == getattr(HF_CONFIG, name), name
    main, compress = HF_CONFIG.rope_parameters["main"], HF_CONFIG.rope_parameters["compress"]
    assert ours.rope_theta == main["rope_theta"] and ours.compress_rope_theta == compress["rope_theta"]
    assert ours.rope_factor == compress["factor"]
    assert ours.original_max_position_embeddings == compress["original_max_position_embeddings"]
    assert (ours.beta_fast, ours.beta_slow) == (compress["beta_fast"], compress["beta_slow"])
    assert ours.compress_ratios == (0, 4, 128)
    assert ours.intermediate_size == 0


def test_config_without_yarn():
    """A plain compress RoPE: no YaRN blend (``original_max_position_embeddings`` 0)."""
    ours = config_from_hf(hf_config(rope_parameters={"rope_type": "default"}))
    assert (ours.rope_factor, ours.original_max_position_embeddings) == (1.0, 0)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(head_dim=256), "head_dim"),
        (dict(head_dim=512, partial_rotary_factor=0.25), "qk_rope_head_dim"),
        (dict(index_head_dim=64), "index_head_dim"),
        (dict(compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 128}),
         r"compress_rates\['compressed_sparse_attention'\]"),
        (dict(rope_parameters={
            "main": {"rope_type": "yarn", "rope_theta": 1e4, "partial_rotary_factor": 0.125, "factor": 4.0,
                     "original_max_position_embeddings": 1024, "attention_factor": 1.0},
            "compress": {"rope_type": "default", "rope_theta": 1.6e5, "partial_rotary_factor": 0.125},
        }), r"rope_parameters\['main'\]\['rope_type'\]"),
        (dict(rope_parameters={  # nested: transformers derives YaRN's attention factor, 0.1 ln 16 + 1
            "main": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.125},
            "compress": {"rope_type": "yarn", "rope_theta": 1.6e5, "partial_rotary_factor": 0.125,
                         "factor": 16.0, "original_max_position_embeddings": 256},
        }), r"rope_parameters\['compress'\]: transformers scales cos/sin"),
    ],
)
def test_config_rejects_what_our_layer_cannot_represent(overrides, field):
    with pytest.raises(ValueError, match=field):
        config_from_hf(hf_config(**overrides))
