"""Hugging Face ``transformers``' DeepSeek V4 attention as a :class:`~dsv4_compile.models.DeepseekV4Attention`.

One attention layer at a time: :func:`config_from_hf` turns a ``transformers`` ``DeepseekV4Config``
into ours, :func:`attention_state_from_hf` maps the parameters of one ``transformers``
``DeepseekV4Attention`` (``model.layers[i].self_attn``, with its compressor and, on
``compressed_sparse_attention`` layers, the compressor's indexer) onto ours, and
:func:`attention_from_hf` builds our layer and loads it. ``transformers`` is needed only for the
checks of :func:`config_from_hf` (its rotary embedding, imported when called); the rest reads
the module's ``state_dict()`` and attributes. Written against transformers 5.17
(``models/deepseek_v4``).

Layer kinds: transformers' ``layer_types`` entry ``sliding_attention`` is our ``compress_ratio``
0, ``compressed_sparse_attention`` (overlapping compressor + lightning indexer) our 4,
``heavily_compressed_attention`` our 128; their ``compress_rates`` must map the two compressed
kinds to 4 and 128, which is what our layers implement.

Name map (:data:`NAME_MAP`), theirs (a key of their ``self_attn.state_dict()``) -> ours (a
parameter of our layer; ``x_proj.weight[name]`` are the rows :meth:`DeepseekV4Attention.x_weight`
gives for ``name``, ``/kv`` and ``/score`` the first and second half of a compressor's
``wkv_gate`` rows, as :class:`~dsv4_compile.models.Compressor` splits them):

=================================================  =====================================================
transformers ``DeepseekV4Attention``               ``dsv4_compile`` ``DeepseekV4Attention``
=================================================  =====================================================
``q_a_proj.weight``                                ``x_proj.weight[wq_a]``
``q_a_norm.weight``                                ``q_norm.weight``
``q_b_proj.weight``                                ``wq_b.weight``
``kv_proj.weight``                                 ``x_proj.weight[wkv]``
``kv_norm.weight``                                 ``kv_norm.weight``
``o_a_proj.weight``                                ``wo_a.weight``
``o_b_proj.weight``                                ``wo_b.weight``
``sinks``                                          ``attn_sink``
``compressor.kv_proj.weight``                      ``x_proj.weight[compressor.wkv_gate/kv]``
``compressor.gate_proj.weight``                    ``x_proj.weight[compressor.wkv_gate/score]``
``compressor.position_bias``                       ``compressor.ape``
``compressor.kv_norm.weight``                      ``compressor.norm_weight``
``compressor.indexer.kv_proj.weight``              ``x_proj.weight[indexer.compressor.wkv_gate/kv]``
``compressor.indexer.gate_proj.weight``            ``x_proj.weight[indexer.compressor.wkv_gate/score]``
``compressor.indexer.position_bias``               ``indexer.compressor.ape``
``compressor.indexer.kv_norm.weight``              ``indexer.compressor.norm_weight``
``compressor.indexer.q_b_proj.weight``             ``indexer.wq_b.weight``
``compressor.indexer.scorer.weights_proj.weight``  ``indexer.weights_proj.weight``
=================================================  =====================================================

A sliding layer has the first eight rows, a ratio-128 layer the first twelve, a ratio-4 layer all.
Their rotary embeddings (one in the attention's model, one in each compressor and indexer) hold
non-persistent buffers only, recomputed from the config; ours are the layer's ``freqs`` table,
built from our config (:func:`config_from_hf` checks that both give the same frequencies).

Transformations: none but the stacking and the dtype.

* No transpose: both sides keep ``nn.Linear``'s ``[out, in]`` weights, and their grouped output
  projection ``o_a_proj`` (``[o_groups * o_lora_rank, heads * head_dim / o_groups]``, viewed as
  ``[o_groups, o_lora_rank, ...]`` against heads split into ``o_groups`` consecutive groups) is
  laid out as our ``wo_a``.
* No permutation of the RoPE dims: both rotate the last 64 dims of a head (448..511) in
  interleaved pairs ``(x[2i], x[2i+1])`` by ``pos * f_i`` (their ``rotate_half`` takes
  ``x[0::2]``, ``x[1::2]`` and their cos/sin are ``repeat_interleave``-d), so ``q_b_proj`` and
  ``kv_proj`` rows map as they are.
* No permutation of the compressors' halves: their ``kv_proj`` / ``gate_proj`` of a
  ``compressed_sparse_attention`` compressor are ``2 * head_dim`` wide, ``[..., :head_dim]``
  the series that pools into the *next* block and ``[..., head_dim:]`` the one for the *current*
  block; ours are the same halves in the same order (the natural checkpoint layout of ``ape``
  too, not SGLang's kernel-side ``apply_ape_hotfix`` permutation). ``position_bias[j]`` is the
  bias of the ``j``-th token of a block, our ``ape[pos % ratio]`` with blocks starting at
  multiples of ``ratio``.
* Stacking: our ``x_proj`` holds the rows of every projection of the layer's input that is not
  head-sharded (``wq_a``, ``wkv``, each compressor's ``wkv_gate`` = ``[kv; score]``); the rows of
  each come from the layer's own :attr:`~DeepseekV4Attention.x_rows` and the compressor's
  ``coff * head_dim`` split, never from offsets computed here.
* Dtype: each tensor is cast to our parameter's dtype: bf16 for the projections and the
  ``q_norm`` / ``kv_norm`` weights (exact for a bf16 checkpoint; transformers keeps ``q_a_norm``
  and ``kv_norm`` in float32, so a float32 weight that is not bf16-representable is rounded),
  float32 for ``attn_sink``, the compressors' ``ape`` and their norm weights.

Only an unsharded layer (tensor-parallel size 1) is filled.

Where transformers' computation differs from ours (their ``modeling_deepseek_v4.py`` and
``modeling_rope_utils.py`` of 5.17; the math is otherwise the same, checked by
``tests/test_transformers_bridge.py``):

* Indexer ties: their ``index_scores.topk`` (``modeling_deepseek_v4.py:573``) picks any of equal
  logits; ours gives ties to the lower block (e.g. blocks whose every head's ReLU is 0).
* Precision: ours rounds activations to bf16 and stores keys as FP8 (the cache formats), theirs
  in the model's dtype. In a bf16 model theirs also rounds cos/sin to bf16 (``:159``) and takes
  the attention softmax in bf16 (``:731``); ours keeps a float32 table and float32 softmax.
* YaRN's ``truncate``: theirs reads it from the top-level ``rope_parameters`` dict
  (``modeling_rope_utils.py:474``), which for V4 holds only ``main`` / ``compress``, so the
  correction range is always truncated, as ours is; a ``truncate`` in the ``compress`` dict has no
  effect on either.
* YaRN's attention factor: a config given in the nested ``{"main", "compress"}`` form without
  ``attention_factor`` gets transformers' derived factor (``0.1 ln(factor) + 1``) on cos/sin;
  DeepSeek V4 and ours apply none, and :func:`config_from_hf` rejects such a config.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

import torch
from torch import nn

from .. import checks, layout
from ..generation import StepLimits
from ..models.attention import DeepseekV4Attention
from ..models.config import CacheConfig, DeepseekV4Config
from ..models.metadata import build_step_metadata
from ..models.model import state_buffers
from ..models.rope import inv_freq

#: transformers' ``layer_types`` entries and our ``compress_ratio`` of each (the compressed kinds'
#: ratios are also read from their ``compress_rates``, which must agree)
LAYER_KINDS = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}

#: theirs -> (our parameter, part): ``part`` None is the whole parameter; otherwise rows of
#: ``x_proj.weight``: a key of the layer's ``x_rows``, with ``/kv`` or ``/score`` for a half of a
#: compressor's ``wkv_gate`` rows
NAME_MAP: dict[str, tuple[str, str | None]] = {
    "q_a_proj.weight": ("x_proj.weight", "wq_a"),
    "q_a_norm.weight": ("q_norm.weight", None),
    "q_b_proj.weight": ("wq_b.weight", None),
    "kv_proj.weight": ("x_proj.weight", "wkv"),
    "kv_norm.weight": ("kv_norm.weight", None),
    "o_a_proj.weight": ("wo_a.weight", None),
    "o_b_proj.weight": ("wo_b.weight", None),
    "sinks": ("attn_sink", None),
    "compressor.kv_proj.weight": ("x_proj.weight", "compressor.wkv_gate/kv"),
    "compressor.gate_proj.weight": ("x_proj.weight", "compressor.wkv_gate/score"),
    "compressor.position_bias": ("compressor.ape", None),
    "compressor.kv_norm.weight": ("compressor.norm_weight", None),
    "compressor.indexer.kv_proj.weight": ("x_proj.weight", "indexer.compressor.wkv_gate/kv"),
    "compressor.indexer.gate_proj.weight": ("x_proj.weight", "indexer.compressor.wkv_gate/score"),
    "compressor.indexer.position_bias": ("indexer.compressor.ape", None),
    "compressor.indexer.kv_norm.weight": ("indexer.compressor.norm_weight", None),
    "compressor.indexer.q_b_proj.weight": ("indexer.wq_b.weight", None),
    "compressor.indexer.scorer.weights_proj.weight": ("indexer.weights_proj.weight", None),
}

#: relative difference allowed between their rotary frequencies and ours: both are float32
#: formulas of the same values, written differently (theirs divides by ``factor * base**e``, ours
#: divides ``1 / base**e`` by ``factor``), so they agree within a couple of float32 roundings
ROPE_FREQ_RTOL = 1e-6


def _hf_field(hf_config, name: str):
    if not hasattr(hf_config, name):
        raise ValueError(f"the transformers config has no {name!r}")
    return getattr(hf_config, name)


def _require(name: str, got, want) -> None:
    if got != want:
        raise ValueError(f"{name} must be {want} for dsv4_compile's DeepseekV4Attention, got {got!r}")


def layer_ratios(hf_config) -> tuple[int, ...]:
    """Our ``compress_ratio`` of each of their layers (``layer_types`` through ``compress_rates``)."""
    rates = dict(_hf_field(hf_config, "compress_rates") or {})
    for kind, ratio in LAYER_KINDS.items():
        if ratio and kind in rates:
            _require(f"compress_rates[{kind!r}]", rates[kind], ratio)
    ratios = []
    for i, kind in enumerate(_hf_field(hf_config, "layer_types")):
        if kind not in LAYER_KINDS:
            raise ValueError(f"layer_types[{i}] must be one of {list(LAYER_KINDS)}, got {kind!r}")
        ratios.append(LAYER_KINDS[kind])
    return tuple(ratios)


def _rope_fields(hf_config, head_dim: int) -> dict:
    """Our RoPE fields from their ``rope_parameters`` ``{"main": ..., "compress": ...}``."""
    params = _hf_field(hf_config, "rope_parameters") or {}
    fields = {}
    for label in ("main", "compress"):
        p = params.get(label)
        if not isinstance(p, Mapping):
            raise ValueError(f"rope_parameters[{label!r}] must be a dict (transformers' nested V4 form), got {p!r}")
        rotary = int(head_dim * p.get("partial_rotary_factor", 1.0))
        _require(f"rope_parameters[{label!r}]['partial_rotary_factor'] * head_dim", rotary, layout.ROPE_DIM)
        kind = p.get("rope_type", p.get("type", "default"))
        if label == "main":
            _require("rope_parameters['main']['rope_type'] (window-only layers rotate without YaRN)", kind, "default")
            fields["rope_theta"] = float(p["rope_theta"])
            continue
        fields["compress_rope_theta"] = float(p["rope_theta"])
        if kind == "default":  # no YaRN: our inv_freq skips the blend for original_max_pos 0
            fields.update(rope_factor=1.0, original_max_position_embeddings=0)
            continue
        if kind != "yarn":
            raise ValueError(f"rope_parameters['compress']['rope_type'] must be 'default' or 'yarn', got {kind!r}")
        original = int(p["original_max_position_embeddings"])
        factor = p.get("factor")
        if factor is None:  # transformers' YaRN: the context extension ratio
            factor = _hf_field(hf_config, "max_position_embeddings") / original
        fields.update(
            rope_factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=float(p.get("beta_fast") or 32),
            beta_slow=float(p.get("beta_slow") or 1),
        )
    return fields


def _check_rope(hf_config, config: DeepseekV4Config) -> None:
    """Their rotary embedding's frequencies and cos/sin scale against ours, per RoPE label."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    theirs = DeepseekV4RotaryEmbedding(hf_config)
    ours = {
        "main": inv_freq(config.qk_rope_head_dim, config.rope_theta),
        "compress": inv_freq(
            config.qk_rope_head_dim, config.compress_rope_theta, factor=config.rope_factor,
            original_max_pos=config.original_max_position_embeddings,
            beta_fast=config.beta_fast, beta_slow=config.beta_slow,
        ),
    }
    for label, want in ours.items():
        scale = getattr(theirs, f"{label}_attention_scaling")
        if scale != 1.0:
            raise ValueError(
                f"rope_parameters[{label!r}]: transformers scales cos/sin by {scale} (YaRN's attention factor; "
                f"set 'attention_factor': 1.0 as DeepSeek V4 does); our RoPE applies no such scale"
            )
        got = getattr(theirs, f"{label}_inv_freq").float().cpu()
        if got.shape != want.shape or not torch.allclose(got, want, rtol=ROPE_FREQ_RTOL, atol=0.0):
            raise ValueError(
                f"rope_parameters[{label!r}]: transformers' rotary frequencies differ from ours "
                f"(theirs {got.tolist()}, ours {want.tolist()})"
            )


def config_from_hf(hf_config) -> DeepseekV4Config:
    """Our :class:`DeepseekV4Config` from a transformers ``DeepseekV4Config``.

    Raises ``ValueError`` naming their field for what our layer cannot represent: more than one KV
    head, a head or indexer width other than the cache layout's (512 with 64 RoPE dims, 128), a
    layer kind or compress rate other than window-only / 4 with indexer / 128, RoPE other than
    plain on window-only layers and plain or YaRN without an attention factor on compressed ones.
    The MoE, hyper-connection and embedding fields are not ours (our ``intermediate_size`` is 0:
    no MLP); ``vocab_size`` is carried over for completeness."""
    kv_heads = _hf_field(hf_config, "num_key_value_heads")
    _require("num_key_value_heads", kv_heads, 1)
    head_dim = _hf_field(hf_config, "head_dim")
    _require("head_dim", head_dim, layout.HEAD_DIM)
    rope_dim = getattr(hf_config, "qk_rope_head_dim", None)
    if rope_dim is None:
        rope_dim = int(head_dim * _hf_field(hf_config, "partial_rotary_factor"))
    _require("qk_rope_head_dim (head_dim * partial_rotary_factor)", rope_dim, layout.ROPE_DIM)
    _require("index_head_dim", _hf_field(hf_config, "index_head_dim"), layout.INDEX_HEAD_DIM)
    window = _hf_field(hf_config, "sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive int, got {window!r}")
    ratios = layer_ratios(hf_config)
    fields = dict(
        vocab_size=_hf_field(hf_config, "vocab_size"),
        hidden_size=_hf_field(hf_config, "hidden_size"),
        num_hidden_layers=_hf_field(hf_config, "num_hidden_layers"),
        num_attention_heads=_hf_field(hf_config, "num_attention_heads"),
        q_lora_rank=_hf_field(hf_config, "q_lora_rank"),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        o_lora_rank=_hf_field(hf_config, "o_lora_rank"),
        o_groups=_hf_field(hf_config, "o_groups"),
        sliding_window=window,
        index_n_heads=_hf_field(hf_config, "index_n_heads"),
        index_head_dim=_hf_field(hf_config, "index_head_dim"),
        index_topk=_hf_field(hf_config, "index_topk"),
        max_position_embeddings=_hf_field(hf_config, "max_position_embeddings"),
        rms_norm_eps=float(_hf_field(hf_config, "rms_norm_eps")),
        compress_ratios=ratios,
        intermediate_size=0,
        **_rope_fields(hf_config, head_dim),
    )
    if len(ratios) < fields["num_hidden_layers"]:
        raise ValueError(f"layer_types needs one entry per layer ({fields['num_hidden_layers']}), got {len(ratios)}")
    num_heads, groups = fields["num_attention_heads"], fields["o_groups"]
    if num_heads % groups:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of o_groups ({groups})")
    config = DeepseekV4Config(**fields)
    _check_rope(hf_config, config)
    return config


def layer_ratio(hf_attn) -> int:
    """Our ``compress_ratio`` of one of their attention layers (from its ``layer_type``)."""
    kind = getattr(hf_attn, "layer_type", None)
    if kind not in LAYER_KINDS:
        raise ValueError(f"the transformers attention's layer_type must be one of {list(LAYER_KINDS)}, got {kind!r}")
    ratio = LAYER_KINDS[kind]
    compressor = getattr(hf_attn, "compressor", None)
    rate = getattr(compressor, "compress_rate", 0) if compressor is not None else 0
    _require(f"the compress_rate of the transformers attention's compressor ({kind})", rate, ratio)
    return ratio


def _rows(layer: DeepseekV4Attention, part: str) -> slice:
    """The rows of ``layer.x_proj.weight`` that ``part`` (a ``NAME_MAP`` part) names."""
    name, _, half = part.partition("/")
    rows = layer.x_rows[name]
    if not half:
        return rows
    compressor = layer.get_submodule(name.rpartition(".")[0])  # "compressor" / "indexer.compressor"
    mid = rows.start + compressor.coff * compressor.head_dim  # [kv; score], each coff * head_dim rows
    return slice(rows.start, mid) if half == "kv" else slice(mid, rows.stop)


def _applies(layer: DeepseekV4Attention, ours: str, part: str | None, params: Mapping) -> bool:
    """Whether a ``NAME_MAP`` target exists in ``layer`` (compressor / indexer entries by kind)."""
    if part is not None:
        return part.partition("/")[0] in layer.x_rows
    return ours in params


def _meta_layer(hf_attn) -> DeepseekV4Attention:
    """Our layer of ``hf_attn``'s config and kind on the meta device: its parameter shapes and
    ``x_proj`` layout, no storage."""
    config = config_from_hf(hf_attn.config)
    return DeepseekV4Attention(config, layer_ratio(hf_attn), CacheConfig(max_requests=1), device="meta")


def attention_state_from_hf(hf_attn, target: DeepseekV4Attention | None = None) -> dict[str, torch.Tensor]:
    """Our parameters ``{name: tensor}`` from one transformers ``DeepseekV4Attention`` (:data:`NAME_MAP`).

    ``target``: the layer whose names, shapes, dtypes and ``x_proj`` layout to fill (default: ours
    of ``hf_attn``'s config and kind, on the meta device). Every one of their ``state_dict()``
    entries is used exactly once and every row of every one of our parameters is filled exactly
    once, else ``ValueError`` naming each missing, unused or mis-shaped parameter (with the
    expected and actual shapes). The tensors are on their parameters' device, in our dtypes."""
    layer = _meta_layer(hf_attn) if target is None else target
    if layer.tp.size != 1:
        raise ValueError(f"attention_state_from_hf fills an unsharded layer; the target has tensor-parallel "
                         f"size {layer.tp.size}")
    theirs = dict(hf_attn.state_dict())
    params = dict(layer.named_parameters())
    device = next(iter(theirs.values())).device if theirs else torch.device("cpu")
    out = {name: torch.empty(p.shape, dtype=p.dtype, device=device) for name, p in params.items()}
    filled = {name: torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.long) for name, p in params.items()}

    problems = []
    applicable = {k: v for k, v in NAME_MAP.items() if _applies(layer, *v, params)}
    for name in sorted(set(theirs) - set(applicable)):
        problems.append(f"unused transformers parameter {name!r} {tuple(theirs[name].shape)}: no dsv4_compile "
                        f"parameter of a compress_ratio-{layer.compress_ratio} layer takes it")
    for name, (ours, part) in applicable.items():
        target_name = ours if part is None else f"{ours}[{part}]"
        if name not in theirs:
            problems.append(f"missing transformers parameter {name!r} (for dsv4_compile's {target_name})")
            continue
        if ours not in params:
            problems.append(f"dsv4_compile's layer has no parameter {ours!r} (for transformers' {name!r})")
            continue
        rows = slice(None) if part is None else _rows(layer, part)
        want_shape = tuple(params[ours][rows].shape)
        got = theirs[name]
        if tuple(got.shape) != want_shape:
            problems.append(f"mis-shaped transformers parameter {name!r} (for dsv4_compile's {target_name}): "
                            f"expected {want_shape}, got {tuple(got.shape)}")
            continue
        with torch.no_grad():
            out[ours][rows] = got.detach().to(device=device, dtype=out[ours].dtype)
        filled[ours][rows if params[ours].dim() else slice(None)] += 1
    for name, count in filled.items():
        for what, bad in (("not filled", count == 0), ("filled more than once", count > 1)):
            if bool(bad.any()):
                where = bad.nonzero().flatten().tolist()
                problems.append(f"dsv4_compile parameter {name!r} {what} (rows {_ranges(where)} "
                                f"of {params[name].shape[0] if params[name].dim() else 1})")
    if problems:
        raise ValueError("transformers -> dsv4_compile attention:\n  " + "\n  ".join(problems))
    return out


def _ranges(rows: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``."""
    spans, start = [], None
    for i, r in enumerate(rows):
        if start is None:
            start = r
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            spans.append(f"{start}..{r}" if r != start else f"{r}")
            start = None
    return ", ".join(spans)


def attention_from_hf(
    hf_attn,
    hf_config,
    cache: CacheConfig | None = None,
    device=None,
    dtype: torch.dtype = torch.bfloat16,
) -> DeepseekV4Attention:
    """Our :class:`DeepseekV4Attention` of ``hf_attn``'s kind, built from ``hf_config``
    (:func:`config_from_hf`) with the caches of ``cache`` (default ``CacheConfig()``) on ``device``,
    loaded from ``hf_attn`` (:func:`attention_state_from_hf`)."""
    config = config_from_hf(hf_config)
    ratio = layer_ratio(hf_attn)
    index = getattr(hf_attn, "layer_idx", None)
    if index is not None and index < len(config.compress_ratios):
        _require(f"the compress ratio of layer_types[{index}]", config.compress_ratios[index], ratio)
    layer = DeepseekV4Attention(config, ratio, cache or CacheConfig(), device=device, dtype=dtype)
    state = attention_state_from_hf(hf_attn, layer)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(state[name])
    return layer


# --------------------------------------------------------------------------------------------
# The whole model: transformers' blocks around our attention, stepped over paged caches
# --------------------------------------------------------------------------------------------

STEP_KWARG = "dsv4_step"  # the keyword a decoder layer forwards to its attention: the step's metadata
#: the keywords transformers passes a cache under (``cache`` from 5.25, ``past_key_values`` before)
CACHE_KEYWORDS = ("cache", "past_key_values")
#: the attention mask transformers' decoder gets from a switched model's forward: a dict, which it
#: takes as masks already built (no ``[B, 1, S, columns]`` mask is made: our attention needs none)
NO_MASK = {"dsv4_paged": None}


class _OurAttention(nn.Module):
    """Stands in for a transformers decoder layer's ``self_attn``: our layer over the step's
    metadata, which the decoder layer forwards from :meth:`TransformersDSV4.forward` as the
    keyword :data:`STEP_KWARG` (transformers' layers pass their keyword arguments on to the
    attention). Their hidden states ``[1, T, hidden]`` are the step's tokens; ours are
    ``[T, hidden]`` in the layer's dtype."""

    def __init__(self, attn: DeepseekV4Attention):
        super().__init__()
        self.attn = attn

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        step = kwargs.get(STEP_KWARG)
        if step is not None:  # TransformersDSV4.forward: the step's tokens packed as one sequence
            x = hidden_states.reshape(-1, hidden_states.shape[-1]).to(self.attn.wq_b.weight.dtype)
            return self.attn(x, step).to(hidden_states.dtype).view_as(hidden_states), None
        from .transformers_cache import PagedCache  # imports transformers, which built this layer's model

        cache = next((v for k, v in kwargs.items() if k in CACHE_KEYWORDS and isinstance(v, PagedCache)), None)
        if cache is None or cache.step is None:
            raise RuntimeError(
                "this transformers model's attention was replaced by dsv4_compile's (paged caches): call the model "
                "itself (its forward or generate(), which TransformersDSV4 prepares) or TransformersDSV4's steps, "
                "not a decoder layer alone")
        return cache.step.attend(self.attn, hidden_states), None


class TransformersDSV4(nn.Module):
    """A transformers ``DeepseekV4ForCausalLM`` whose attention layers are ours: paged FP8 caches,
    the ``dsv4`` ops, one ``torch.compile`` graph per step kind.

    Each decoder layer's ``self_attn`` is replaced, in ``hf_model`` itself, by our
    :class:`DeepseekV4Attention` loaded from it (:func:`attention_from_hf`, caches of ``cache``:
    formats, pages, requests); everything else stays transformers' own modules and code — the
    embedding, the hyper-connections (mHC), the norms, the MoE, the hyper head and the LM head.

    Two ways to run it:

    * transformers' own: ``hf_model(input_ids, attention_mask=...)`` and ``hf_model.generate(...)``
      (greedy or sampling; batches padded left or right) run on our attention through a
      :class:`~dsv4_compile.integrations.transformers_cache.PagedCache`, which ``generate()``
      creates (or pass one as the cache) and a forward without one makes for itself: a hook
      before transformers' decoder packs each step's real tokens.
    * ours: a step takes the package's step inputs (:func:`dsv4_compile.generation.step_inputs`:
      the tokens of several requests packed into one sequence, their positions, batch rows,
      lengths and cache rows) and returns the logits of each request's last token, like
      :class:`dsv4_compile.models.DeepseekV4Model`, so :func:`dsv4_compile.generation.generate`
      drives prefill and greedy decode, one graph per step kind under ``torch.compile``.

    Both use the model's caches: one at a time (a new ``PagedCache`` or :meth:`reset_caches`
    zeroes them, and an older ``PagedCache`` then refuses to step)."""

    def __init__(self, hf_model, cache: CacheConfig, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config = config_from_hf(hf_model.config)
        self.cache = cache
        #: the step inputs' bounds, as the model's (:class:`~dsv4_compile.generation.StepLimits`)
        self.step_limits = StepLimits(self.config.vocab_size, self.config.max_position_embeddings, cache.max_seq_len,
                                      cache.max_requests)
        self.hf = hf_model
        base = hf_model.model
        device = device if device is not None else next(hf_model.parameters()).device
        wrapped = [i for i, layer in enumerate(base.layers) if isinstance(layer.self_attn, _OurAttention)]
        if wrapped:  # their caches and formats are another wrapper's: sharing them would be a silent surprise
            raise ValueError(
                f"hf_model: the attention of layers {wrapped} is already ours (an earlier TransformersDSV4 replaced "
                f"it in place, with that wrapper's caches); expected a transformers model with its own attention: "
                f"wrap a copy (copy.deepcopy) or reload the model")
        for layer in base.layers:
            layer.self_attn = _OurAttention(attention_from_hf(layer.self_attn, hf_model.config, cache, device, dtype))
        attns = [layer.self_attn.attn for layer in base.layers]
        self.compressed_ratios = tuple(sorted({a.compress_ratio for a in attns if a.compress_ratio}))
        #: each layer kind's extra index width: the step's decode schedules, all in one call
        self.extra_widths = {a.compress_ratio: a.extra_width for a in attns}
        pages = torch.arange(cache.num_pages, dtype=torch.int32, device=device)
        self.register_buffer("page_table", pages.view(cache.max_requests, cache.pages_per_request), persistent=False)
        #: bumped whenever the caches are zeroed for a new owner (:meth:`claim_caches`)
        self.cache_epoch = 0
        self._hooks = _switch_transformers_entry_points(self)

    def step_metadata(self, positions, batch_index, seq_lens, req_slots, mode: str):
        """The step metadata of our attention layers over this model's caches (traceable)."""
        return build_step_metadata(
            positions, batch_index, seq_lens, req_slots, self.page_table, cache=self.cache,
            window=self.config.sliding_window, ratios=self.compressed_ratios, mode=mode,
            extra_widths=self.extra_widths,
        )

    @torch.no_grad()
    def claim_caches(self) -> int:
        """Zero the caches for a new owner (a :class:`PagedCache`); returns the new epoch, which
        an older owner's next step finds changed."""
        self.reset_caches()
        return self.cache_epoch

    def forward(self, input_ids, positions, batch_index, seq_lens, req_slots, mode: str = "decode") -> torch.Tensor:
        if not torch.compiler.is_compiling() and checks.checked_mode():  # a device sync
            self.step_limits.check(input_ids, positions, req_slots)
        meta = self.step_metadata(positions, batch_index, seq_lens, req_slots, mode)
        base = self.hf.model
        ids = input_ids[None]  # the step's tokens as one sequence: [1, T]
        h = base.embed_tokens(ids)
        streams = h.unsqueeze(2).expand(-1, -1, self.hf.config.hc_mult, -1).contiguous()  # mHC's residual streams
        for layer in base.layers:
            streams = layer(streams, input_ids=ids, **{STEP_KWARG: meta})
        h = base.norm(base.hc_head(streams))[0]
        return self.hf.lm_head(h[meta.last_rows]).float()

    @torch.no_grad()
    def reset_caches(self) -> None:
        """Zero every cache and compressor state of our attention layers (addresses kept; their
        modules' other persistent buffers, e.g. the MoE's routing tables, are transformers'); a
        live :class:`PagedCache` of the model becomes stale."""
        for layer in self.hf.model.layers:
            for buf in state_buffers(layer.self_attn.attn).values():
                buf.zero_()
        self.cache_epoch += 1


#: ``generate()`` modes the switched model runs (transformers' ``GenerationMode`` values); the
#: others need a cache that can be reordered, rolled back or expanded (``transformers_cache.UNSUPPORTED``)
GENERATION_MODES = ("greedy_search", "sample")
#: the ``generate()`` option behind each refused mode (a part of the mode's name -> the option)
MODE_OPTIONS = {"beam": "num_beams > 1", "assisted": "assistant_model or prompt_lookup_num_tokens",
                "contrastive": "penalty_alpha", "dola": "dola_layers"}


def _switch_transformers_entry_points(model: TransformersDSV4) -> list:
    """Make ``model.hf``'s own ``forward`` and ``generate()`` run on our attention: a forward
    pre-hook on its decoder (``model.hf.model``) that steps a :class:`PagedCache` (the one passed,
    or a new one) and hands the decoder :data:`NO_MASK`, and ``generate()``'s cache preparation
    replaced (on the instance) by one that makes a :class:`PagedCache` and refuses the modes it
    cannot serve. Returns the hook handles."""
    from .transformers_cache import PagedCache

    hf = model.hf
    decoder = hf.model
    keyword = _cache_keyword(type(decoder))

    @torch.compiler.disable  # host work (the mask read on the host): run as it is, not traced
    def begin_step(module, args, kwargs):
        given = next(((k, v) for k, v in kwargs.items() if k in CACHE_KEYWORDS and v is not None), None)
        key, cache = given if given is not None else (keyword, None)
        if not isinstance(cache, PagedCache):
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError(f"{key} must be a PagedCache of this switched model (its attention keeps paged "
                                 f"caches), got a {type(cache).__name__} holding {cache.get_seq_length()} tokens")
            cache = PagedCache(model)
        elif cache.model is not model:
            raise ValueError(f"{key} must be a PagedCache of this switched model, got one of another model")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("inputs_embeds is not supported by the switched model (its steps are packed by token "
                             "ids and attention_mask): pass input_ids")
        cache.begin_step(input_ids, kwargs.get("attention_mask"))
        kwargs[key] = cache
        kwargs["attention_mask"] = NO_MASK
        return args, kwargs

    handles = [decoder.register_forward_pre_hook(begin_step, with_kwargs=True)]
    prepare = type(hf)._prepare_cache_for_generation
    signature = inspect.signature(prepare)

    def prepare_cache(*args, **kwargs):
        bound = signature.bind(hf, *args, **kwargs).arguments
        config, model_kwargs, mode = bound["generation_config"], bound["model_kwargs"], bound["generation_mode"]
        mode = getattr(mode, "value", mode)
        if mode not in GENERATION_MODES:
            option = next((o for key, o in MODE_OPTIONS.items() if key in str(mode)), "its options")
            raise ValueError(f"generate(): {mode} ({option}) is not supported by the switched model (paged caches "
                             f"that cannot be reordered, rolled back or expanded): the generation mode must be one "
                             f"of {list(GENERATION_MODES)} (num_beams=1, no assistant_model, "
                             f"prompt_lookup_num_tokens, penalty_alpha or dola_layers)")
        if getattr(config, "cache_implementation", None) is not None:
            raise ValueError(f"generate(): cache_implementation must be None for the switched model (it runs on a "
                             f"PagedCache), got {config.cache_implementation!r}")
        key = next((k for k in CACHE_KEYWORDS if model_kwargs.get(k) is not None), keyword)
        given = model_kwargs.get(key)
        if given is not None and not (isinstance(given, PagedCache) and given.model is model):
            raise ValueError(f"generate(): {key} must be a PagedCache of this switched model, got "
                             f"{type(given).__name__}")
        if given is None and getattr(config, "use_cache", True) is not False:
            model_kwargs[key] = PagedCache(model)

    hf._prepare_cache_for_generation = prepare_cache
    return handles


def tiny_hf_config(**overrides):
    """A small transformers ``DeepseekV4Config`` for tests and examples: hidden 128, 4 heads of 512
    (64 RoPE dims, as DSV4), one layer of each kind (sliding, ratio 4 with an indexer of 8 heads
    of 128 picking 8 blocks, ratio 128), a window of 16 tokens, 4 routed experts (2 per token)
    and a vocabulary of 256; YaRN on the compressed layers over an original context of 256
    positions, so the blend moves frequencies that short sequences reach. Eager attention.
    ``overrides``: any other config field."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config as HFConfig

    fields = dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=layout.HEAD_DIM, q_lora_rank=64, o_lora_rank=64, o_groups=2, sliding_window=16,
        index_n_heads=8, index_head_dim=layout.INDEX_HEAD_DIM, index_topk=8, layer_types=list(LAYER_KINDS),
        max_position_embeddings=4096, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},
    )
    fields.update(overrides)
    config = HFConfig(**fields)
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def random_hf_model(hf_config, seed: int = 0, device=None, dtype: torch.dtype = torch.float32):
    """transformers' ``DeepseekV4ForCausalLM`` of ``hf_config`` on ``device`` in ``dtype``, its
    parameters seeded random bf16 values (their initialisation leaves most of them empty), ``z`` a
    standard normal draw: the hyper-connections' vectors ``0.1 z``, matrices ``z / sqrt(fan_in)``,
    norm weights ``1 + 0.1 z``, the other vectors (sinks, position biases, biases) ``0.5 z``."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM

    with torch.device(device if device is not None else "cpu"):
        model = DeepseekV4ForCausalLM(hf_config).to(dtype).eval()
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        value = torch.randn(p.shape, generator=gen, device=p.device)
        if "hc_" in name and p.dim() <= 1:
            value *= 0.1
        elif p.dim() >= 2:
            value *= p.shape[-1] ** -0.5
        elif "norm" in name:
            value = 1 + 0.1 * value
        else:
            value *= 0.5
        p.copy_(value.to(torch.bfloat16))
    return model


@functools.cache
def _cache_keyword(model_class: type) -> str:
    """The cache's keyword (and output field) of ``model_class.forward``: ``cache`` from
    transformers 5.25, ``past_key_values`` before it (deprecated there, removed in 5.40)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def hf_cached_forward(hf_model, input_ids: torch.Tensor, cache=None):
    """transformers' own model (not a :class:`TransformersDSV4`) one step on with its own cache:
    ``(logits, cache)``, under either version's keyword (:func:`_cache_keyword`, looked up once per
    model class, not per step)."""
    name = _cache_keyword(type(hf_model))
    out = hf_model(input_ids, use_cache=True, **({name: cache} if cache is not None else {}))
    return out.logits, out[name]


__all__ = [
    "STEP_KWARG",
    "TransformersDSV4",
    "LAYER_KINDS",
    "NAME_MAP",
    "attention_from_hf",
    "attention_state_from_hf",
    "config_from_hf",
    "hf_cached_forward",
    "layer_ratio",
    "layer_ratios",
    "random_hf_model",
    "tiny_hf_config",
]
