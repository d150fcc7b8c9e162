"""A transformers ``DeepseekV4ForCausalLM`` with our attention (:class:`TransformersDSV4`) against
transformers' own eager model: logits of every step fed the same tokens, greedy choices, one
graph per step. The indexer's top-k covers every visible block here (``index_topk`` 64 over at
most 48 blocks), so both select the same keys; the layer tests check the selection itself."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from dsv4_compile.generation import Batch, decode_inputs, generate, prefill_inputs, random_prompts  # noqa: E402
from dsv4_compile.integrations.transformers import TransformersDSV4, hf_cached_forward, random_hf_model  # noqa: E402
from dsv4_compile.models import CacheConfig  # noqa: E402
from dsv4_compile.tolerances import rerounded_atol  # noqa: E402
from helpers import assert_same_choices_but_near_ties, assert_steps_close  # noqa: E402
from test_transformers_bridge import hf_config  # noqa: E402

STEPS = 4
CACHE = CacheConfig(max_requests=4, max_seq_len=512, page_size=256, kv_format="v4", index_format="fp32")


@pytest.fixture(scope="module")
def models():
    theirs = random_hf_model(hf_config(index_topk=64))
    return theirs, TransformersDSV4(copy.deepcopy(theirs), CACHE)


def test_logits_match_transformers_at_every_step(models):
    theirs, ours = models
    prompts = random_prompts(theirs.config.vocab_size, (5, 37, 150))
    logits = []
    with torch.no_grad():
        ours.reset_caches()
        tokens = generate(ours, ours, prompts, STEPS, "cpu", on_step=lambda s, l: logits.append(l))
        want = []
        for p, t in zip(prompts, tokens):  # their eager model over each whole sequence, no cache
            want.append(theirs(torch.tensor(p + t[:-1])[None]).logits[0, len(p) - 1:])
    want_steps = [torch.stack([w[s] for w in want]) for s in range(STEPS + 1)]
    assert_steps_close(logits, want_steps, rerounded_atol)
    their_tokens = [[int(w[s].argmax()) for s in range(STEPS + 1)] for w in want]
    assert_same_choices_but_near_ties(want_steps, their_tokens, tokens, rerounded_atol)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_step_is_one_graph_without_breaks(models, mode):
    _, ours = models
    batch = Batch(random_prompts(ours.hf.config.vocab_size, (5, 37)))
    inputs = prefill_inputs(batch.tokens, "cpu") if mode == "prefill" else decode_inputs(batch, "cpu")
    with torch.no_grad():
        explanation = torch._dynamo.explain(ours)(**inputs, mode=mode)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


def test_a_replaced_attention_alone_is_refused_with_a_message(models):
    """Our attention runs within a step (ours, or transformers' forward through a PagedCache);
    called alone, as a decoder layer would without either, it says what to call."""
    _, ours = models
    with torch.no_grad(), pytest.raises(RuntimeError, match="call the model itself"):
        ours.hf.model.layers[0].self_attn(torch.zeros(1, 3, 128))


def test_wrapping_a_wrapped_model_again_is_refused(models):
    _, ours = models
    before = [layer.self_attn for layer in ours.hf.model.layers]
    with pytest.raises(ValueError, match=r"hf_model: the attention of layers \[0, 1, 2\] is already ours"):
        TransformersDSV4(ours.hf, CacheConfig(max_requests=2, max_seq_len=256, page_size=256, kv_format="v4.1-fp8"))
    assert all(layer.self_attn is b for layer, b in zip(ours.hf.model.layers, before)), "the refused call replaced layers"


def test_hf_cached_forward_steps_their_model_with_its_cache(models):
    """transformers' own model stepped one token at a time with its cache (the keyword of the
    installed version) gives the logits of its forward over the whole sequence."""
    theirs, _ = models
    tokens = torch.tensor([random_prompts(theirs.config.vocab_size, (140,))[0]])
    with torch.no_grad():
        want = theirs(tokens).logits[0]
        logits, cache = hf_cached_forward(theirs, tokens[:, :130])
        steps = [logits[0, -1]]
        for t in range(130, 139):
            logits, cache = hf_cached_forward(theirs, tokens[:, t : t + 1], cache)
            steps.append(logits[0, -1])
    torch.testing.assert_close(torch.stack(steps), want[129:139], atol=1e-4, rtol=1e-4)
