"""A transformers ``Cache`` over a :class:`~dsv4_compile.integrations.transformers.TransformersDSV4`'s
paged caches, so that the switched model's own ``forward()`` and ``generate()`` run on our attention.

transformers steps a batch as ``input_ids [B, S]`` with a 2-D ``attention_mask`` over every column
so far (0: padding, left or right); our attention steps packed tokens of requests (docs/design.md
§4). :class:`PagedCache` maps batch row ``b`` to request slot ``b`` of the switched model's caches
(its page-table row; the caches, compressor states and indexer keys are the model's buffers,
shared by every ``PagedCache`` of it) and keeps each row's stored token count. Before each forward
of transformers' decoder (a forward pre-hook, :meth:`PagedCache.begin_step`) it reads the new
columns of the mask on the host, packs the step's real tokens (padding is neither stored nor
attended) and builds the step's metadata; each replaced attention layer gathers those tokens
from its ``[B, S, hidden]`` input, runs ours, and scatters the outputs back (zero at padding).

transformers' notions kept: ``get_seq_length()`` is the mask's width so far (padding columns
included), positions are each row's real-token count (what ``generate()``'s ``position_ids``
hold for left padding). Not supported, with an error naming the option: beam search
(``num_beams > 1``: ``reorder_cache``), ``crop`` (assisted decoding, ``prompt_lookup_num_tokens``,
and other rollbacks: the compressors' states cannot be rolled back), batch expansion or
selection (``num_return_sequences > 1``, contrastive search).

One ``PagedCache`` of a model is live at a time: a new one (``generate()`` makes one a call, a
forward without a cache one a call) resets the model's caches, and a stale one refuses to step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

#: What a refused operation needs instead, by the transformers feature that calls it.
UNSUPPORTED = {
    "reorder_cache": "beam search (num_beams > 1) is not supported on dsv4_compile's paged caches: use "
                     "num_beams=1 (greedy or sampling)",
    "crop": "rolling the cache back (assisted decoding, prompt_lookup_num_tokens, DoLa and the like) is not "
            "supported on dsv4_compile's paged caches: the compressors' states cannot be rolled back",
    "batch_repeat_interleave": "expanding a cache's batch (num_return_sequences > 1 with a cache, contrastive "
                               "search) is not supported on dsv4_compile's paged caches: repeat the prompts instead",
    "batch_select_indices": "selecting rows of a cache's batch is not supported on dsv4_compile's paged caches",
}


class PagedStep:
    """One forward's packing: ``index`` ``[T]`` int64, the flat ``b * S + s`` positions of the real
    tokens of ``input_ids [B, S]`` in request order; ``meta``, their step metadata (``None`` for a
    step without real tokens)."""

    def __init__(self, index: torch.Tensor, meta):
        self.index, self.meta = index, meta

    def attend(self, attn, hidden_states: torch.Tensor) -> torch.Tensor:
        """``attn`` (our layer) over this step's real tokens of ``hidden_states [B, S, hidden]``:
        ``[B, S, hidden]`` in ``hidden_states``' dtype, zero at padding."""
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = torch.zeros_like(flat)
        if self.meta is not None:
            x = flat.index_select(0, self.index).to(attn.wq_b.weight.dtype)
            out.index_copy_(0, self.index, attn(x, self.meta).to(flat.dtype))
        return out.view_as(hidden_states)


class PagedCache(Cache):
    """transformers' cache of a :class:`TransformersDSV4`: batch row ``b`` is request slot ``b`` of
    its paged caches (``CacheConfig.max_requests`` rows at most). See the module's docstring."""

    def __init__(self, model):
        super().__init__(layers=[])
        self.model = model
        self.lengths: list[int] = []  # real tokens stored per batch row
        self.columns = 0  # the attention mask's width so far (transformers' sequence length)
        self.step: PagedStep | None = None
        self.epoch = model.claim_caches()

    # ---- what transformers asks of a cache ------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # per row: CacheConfig.max_seq_len real tokens, whatever the padding

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.columns + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return bool(self.lengths)

    def reset(self) -> None:
        """Forget every row (the model's caches zeroed; this cache stays the live one)."""
        self.epoch = self.model.claim_caches()
        self.lengths, self.columns, self.step = [], 0, None

    def reorder_cache(self, beam_idx: torch.Tensor):
        raise ValueError(UNSUPPORTED["reorder_cache"])

    def crop(self, *args, **kwargs) -> None:
        raise ValueError(UNSUPPORTED["crop"])

    def batch_repeat_interleave(self, repeats: int):
        raise ValueError(UNSUPPORTED["batch_repeat_interleave"])

    def batch_select_indices(self, indices: torch.Tensor):
        raise ValueError(UNSUPPORTED["batch_select_indices"])

    def __repr__(self) -> str:
        return f"PagedCache(rows={len(self.lengths)}, columns={self.columns}, lengths={self.lengths})"

    # ---- a step ---------------------------------------------------------------------------------

    def begin_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> PagedStep:
        """Pack the real tokens of ``input_ids [B, S]`` (the columns of ``attention_mask`` ``[B,
        columns + S]`` past those seen; ``None``: every token real), check them against the
        model's bounds (nothing is stored when one is out of bounds), build the step's metadata,
        and count the tokens stored. A host sync: the mask is read on the host."""
        if self.epoch != self.model.cache_epoch:
            raise ValueError("this PagedCache is stale: a newer cache (another generate() or a forward without a "
                             "cache) reset the model's paged caches since; start again from the prompt")
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens] (the switched model takes token ids, not "
                             f"inputs_embeds), got {None if input_ids is None else list(input_ids.shape)}")
        batch, width = input_ids.shape
        capacity = self.model.cache.max_requests
        if not self.lengths:
            if batch > capacity:
                raise ValueError(f"batch size must be <= {capacity} (CacheConfig.max_requests of the switched model), "
                                 f"got {batch}")
            self.lengths = [0] * batch
        elif batch != len(self.lengths):
            raise ValueError(f"input_ids must have this cache's {len(self.lengths)} batch rows, got {batch}")
        if attention_mask is None:
            real = torch.ones(batch, width, dtype=torch.bool)
        else:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < width:
                raise ValueError(f"attention_mask must be a 2-D [batch, columns] padding mask covering the "
                                 f"step's {width} tokens, got {list(attention_mask.shape)}")
            real = attention_mask[:, -width:].bool().cpu()
        counts = real.sum(1)  # real tokens per batch row
        flat = real.flatten().nonzero().flatten()  # b * width + s, in row order
        stored = torch.tensor(self.lengths)
        positions = (stored[:, None] + real.cumsum(1) - 1).flatten()[flat]
        rows = (counts > 0).nonzero().flatten()  # batch rows with a token in this step: request slots
        token_rows = flat // width
        # bounds on the host, before anything is stored: ids, positions, slots (messages name them)
        self.model.step_limits.check(input_ids.flatten().cpu()[flat], positions, token_rows)
        device = self.model.page_table.device
        meta = None
        if flat.numel():
            meta = self.model.step_metadata(
                positions=positions.to(device),
                batch_index=((counts > 0).cumsum(0) - 1)[token_rows].to(device),
                seq_lens=(stored + counts)[rows].to(device),
                req_slots=rows.to(device),
                mode="decode" if bool((counts[rows] == 1).all()) else "prefill",
            )
        self.lengths = (stored + counts).tolist()
        self.columns += width
        flat = flat.to(device)
        self.step = PagedStep(flat, meta)
        return self.step

