"""``DeepseekV4Config.index_reuse``: the first of every ``n`` consecutive ratio-4 layers runs its
indexer, the next ``n - 1`` attend the blocks it selected (opt-in; default 1: every layer its own)."""

from __future__ import annotations

import pytest
import torch

from dsv4_compile.generation import Batch, decode_inputs, prefill_inputs, random_prompts
from dsv4_compile.models import CacheConfig, DeepseekV4Attention, DeepseekV4Model, tiny_config
from dsv4_compile.models.indexer import Indexer

RATIOS = (0, 4, 4, 128, 4, 4)  # ratio-4 layers 1, 2, 4, 5: with n = 2, layers 2 and 5 reuse
CACHE = CacheConfig(max_requests=3, max_seq_len=512, page_size=256)


def make_model(index_reuse: int) -> DeepseekV4Model:
    config = tiny_config(sliding_window=16, compress_ratios=RATIOS, num_hidden_layers=len(RATIOS),
                         index_reuse=index_reuse)
    return DeepseekV4Model(config, CACHE, seed=0)


def prompts() -> list[list[int]]:
    return random_prompts(256, [90, 200, 37], seed=5)


def test_index_reuse_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"index_reuse must be an int >= 1 .*, got {bad!r}"):
            tiny_config(index_reuse=bad)
    with pytest.raises(ValueError, match="reuse_selection is for ratio-4 layers .*, got compress_ratio 128"):
        DeepseekV4Attention(tiny_config(), 128, CACHE, reuse_selection=True)


def test_which_layers_reuse():
    flags = [layer.attn.reuse_selection for layer in make_model(2).layers]
    assert flags == [False, False, True, False, False, True]
    assert not any(layer.attn.reuse_selection for layer in make_model(1).layers)
    assert [layer.attn.reuse_selection for layer in make_model(3).layers] == [False, False, True, False, True, False]


def record_indexers(models, monkeypatch) -> list[tuple[int, torch.Tensor]]:
    """Every indexer call of ``models`` as ``(layer, selection)``."""
    calls = []
    owner = {id(layer.attn.indexer): i for model in models for i, layer in enumerate(model.layers) if layer.attn.indexer}
    forward = Indexer.forward

    def recorded(self, *args):
        blocks, tokens = forward(self, *args)
        calls.append((owner[id(self)], blocks))
        return blocks, tokens

    monkeypatch.setattr(Indexer, "forward", recorded)
    return calls


def test_reusing_layers_attend_the_selection_of_the_layer_before(monkeypatch):
    """With ``n = 2`` only the indexers of layers 1 and 4 run, and every step (a prefill, then a
    decode) equals the default model's with layers 2 and 5 made to select what layers 1 and 4
    selected in that step: bit for bit."""
    reuse, own = make_model(2), make_model(1)
    calls = record_indexers([reuse, own], monkeypatch)
    steps = [(prefill_inputs(prompts(), "cpu"), "prefill"), (decode_inputs(Batch([p + [7] for p in prompts()]), "cpu"), "decode")]
    with torch.no_grad():
        for inputs, mode in steps:
            calls.clear()
            got = reuse(**inputs, mode=mode)
            assert [layer for layer, _ in calls] == [1, 4], mode
            selections = dict(calls)
            for source, follower in ((1, 2), (4, 5)):
                own.layers[follower].attn.indexer.select = lambda *args, s=selections[source]: s
            calls.clear()
            want = own(**inputs, mode=mode)
            assert [layer for layer, _ in calls] == [1, 2, 4, 5], mode
            assert torch.equal(got, want), mode


def test_reuse_compiles_to_one_graph_without_breaks():
    model = make_model(2)
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(**prefill_inputs(prompts(), "cpu"), mode="prefill")
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
