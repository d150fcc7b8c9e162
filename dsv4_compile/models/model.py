"""A small DSV4 language model around :class:`DeepseekV4Attention`.

Not DSV4's full decoder: it has the DSV4 attention block of each layer kind, pre-norm residual
layers with an optional small SwiGLU MLP (DSV4's MoE and hyper-connections are out of scope), an
embedding and an LM head, random weights from a seed. Its purpose is to run real prefill and decode
steps through the ``dsv4`` ops, eagerly and under ``torch.compile``.

A step is ``model(input_ids, positions, batch_index, seq_lens, req_slots, mode=...)``: the step
metadata is built inside ``forward`` (once, shared by every layer), so one ``torch.compile`` of the
model captures the whole step in one graph. It returns the float32 logits of each batch row's last
token ``[B, vocab]``. Requests own fixed rows of the page table (``req_slots``). Step inputs and
greedy generation are in :mod:`dsv4_compile.generation`.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import checks
from ..generation import StepLimits
from .attention import DeepseekV4Attention
from .config import CacheConfig, DeepseekV4Config
from .metadata import build_step_metadata
from .norm import RMSNorm
from .parallel import SINGLE, TensorParallel, full_shape, shard_, shard_dim, take_shard


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate x) * up x)``; under tensor parallelism ``gate``/``up`` are
    column-parallel, ``down`` row-parallel, then an all-reduce."""

    def __init__(self, hidden: int, intermediate: int, *, device=None, dtype=torch.bfloat16, tp=SINGLE):
        super().__init__()
        self.tp = tp
        linear = dict(bias=False, device=device, dtype=dtype)
        local = tp.split("intermediate_size", intermediate)
        self.gate = nn.Linear(hidden, local, **linear)
        self.up = nn.Linear(hidden, local, **linear)
        self.down = nn.Linear(local, hidden, **linear)
        for module, dim in ((self.gate, 0), (self.up, 0), (self.down, 1)):
            shard_(module, weight=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down(nn.functional.silu(self.gate(x)) * self.up(x)))


class DecoderLayer(nn.Module):
    """``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, config, compress_ratio, cache, *, device=None, dtype=torch.bfloat16, tp=SINGLE,
                 reuse_selection=False):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_norm = RMSNorm(config.hidden_size, eps, device=device, dtype=dtype)
        self.attn = DeepseekV4Attention(config, compress_ratio, cache, device=device, dtype=dtype, tp=tp,
                                        reuse_selection=reuse_selection)
        self.mlp = None
        if config.intermediate_size:
            self.post_attention_norm = RMSNorm(config.hidden_size, eps, device=device, dtype=dtype)
            self.mlp = MLP(config.hidden_size, config.intermediate_size, device=device, dtype=dtype, tp=tp)

    def forward(self, h: torch.Tensor, meta) -> torch.Tensor:
        h = residual_add(h, self.attn(self.input_norm(h), meta))
        if self.mlp is not None:
            h = residual_add(h, self.mlp(self.post_attention_norm(h)))
        return h


def residual_add(h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``h + delta`` as PyTorch computes a bf16 add (in float32, rounded once to ``h.dtype``), so
    the same bits. Written through float32 so that, when ``delta`` is a GEMM's output, Inductor
    keeps the GEMM plain and fuses the sum into the next kernel, instead of making an ``addmm``
    that first copies ``h`` into its output (benchmarks/RESULTS.md, "Model decode step")."""
    return (h.float() + delta.float()).to(h.dtype)


class DeepseekV4Model(nn.Module):
    """Embedding, ``num_hidden_layers`` DSV4 layers, final norm, LM head; seeded random weights.

    ``tp``: tensor parallelism over ``torch.distributed`` (:class:`~.parallel.TensorParallel`,
    e.g. ``TensorParallel.from_group()`` on each rank): the rank holds its share of the heads and
    the same weights as the unsharded model of the same seed; every rank returns the full logits.

    ``step_limits`` (:class:`~dsv4_compile.generation.StepLimits`): the bounds of a step's token
    ids, positions and request slots; :mod:`dsv4_compile.generation` checks them on the host
    before every step it builds, and ``forward`` checks them in checked mode (eager).
    """

    def __init__(
        self,
        config: DeepseekV4Config,
        cache: CacheConfig,
        *,
        seed: int = 0,
        device=None,
        dtype=torch.bfloat16,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.config, self.cache = config, cache
        self.step_limits = StepLimits(config.vocab_size, config.max_position_embeddings, cache.max_seq_len,
                                      cache.max_requests)
        self.tp = tp = tp or SINGLE
        ratios = config.compress_ratios[: config.num_hidden_layers]
        self.compressed_ratios = tuple(sorted({r for r in ratios if r}))
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        # index_reuse: the first of every index_reuse consecutive ratio-4 layers runs its indexer
        c4_ordinal = [sum(1 for q in ratios[:i] if q == 4) for i in range(len(ratios))]
        self.layers = nn.ModuleList(
            DecoderLayer(config, r, cache, device=device, dtype=dtype, tp=tp,
                         reuse_selection=r == 4 and c4_ordinal[i] % config.index_reuse != 0)
            for i, r in enumerate(ratios)
        )
        #: each layer kind's extra index width: the step's decode schedules, all in one call
        self.extra_widths = {layer.attn.compress_ratio: layer.attn.extra_width for layer in self.layers}
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype
        )
        pages = torch.arange(cache.num_pages, dtype=torch.int32, device=device)
        self.register_buffer(
            "page_table", pages.view(cache.max_requests, cache.pages_per_request), persistent=False
        )
        init_random_(self, seed)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch_index: torch.Tensor,
        seq_lens: torch.Tensor,
        req_slots: torch.Tensor,
        mode: str = "decode",
    ) -> torch.Tensor:
        if not torch.compiler.is_compiling() and checks.checked_mode():  # a device sync
            self.step_limits.check(input_ids, positions, req_slots)
        meta = build_step_metadata(
            positions, batch_index, seq_lens, req_slots, self.page_table,
            cache=self.cache, window=self.config.sliding_window,
            ratios=self.compressed_ratios, mode=mode, extra_widths=self.extra_widths,
        )
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, meta)
        return self.lm_head(self.norm(h[meta.last_rows])).float()

    def state_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers a step mutates, by qualified name (:func:`state_buffers`)."""
        return state_buffers(self)

    @torch.no_grad()
    def reset_caches(self) -> None:
        """Zero every state buffer (:meth:`state_buffers`) in place (addresses kept)."""
        for buf in self.state_buffers().values():
            buf.zero_()


def state_buffers(root: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a step of ``root``'s layers mutates, by qualified name: every cache, compressor
    state and indexer key buffer. They are the persistent buffers; constants (page table, RoPE
    tables) are registered non-persistent."""
    return {
        f"{prefix}{'.' if prefix else ''}{name}": buf
        for prefix, module in root.named_modules()
        for name, buf in module.named_buffers(recurse=False)
        if name not in module._non_persistent_buffers_set
    }


@torch.no_grad()
def init_random_(module: nn.Module, seed: int) -> None:
    """Seeded random weights: linears ``N(0, 1/fan_in)``, norm weights ``1 + N(0, 0.1)``,
    ``ape`` ``N(0, 0.5)``, ``attn_sink`` ``N(0, 1)``, embeddings ``N(0, 1)``. A tensor-parallel
    shard (:mod:`.parallel`; ``module.tp`` says which rank) is drawn at the full shape and sliced:
    the weights do not depend on the number of ranks."""
    gen = torch.Generator().manual_seed(seed)
    tp = getattr(module, "tp", SINGLE)
    for name, p in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        dim = shard_dim(module.get_submodule(owner), leaf)
        shape = p.shape if dim is None else full_shape(p.shape, tp, dim)
        if leaf == "weight" and p.dim() == 2:
            std = 1.0 if name.startswith("embed") else shape[1] ** -0.5
            value = torch.randn(shape, generator=gen) * std
        elif "norm" in name:
            value = 1 + 0.1 * torch.randn(shape, generator=gen)
        elif leaf == "ape":
            value = 0.5 * torch.randn(shape, generator=gen)
        else:  # attn_sink
            value = torch.randn(shape, generator=gen)
        p.copy_((value if dim is None else take_shard(value, tp, dim)).to(p.dtype))
