"""transformers' own ``forward()`` and ``generate()`` of a switched model (:class:`TransformersDSV4`,
through its :class:`PagedCache`) against transformers' own eager model run on each prompt alone
(no padding): padded batches of prompts of unequal lengths give each prompt's logits (those of the
prompt alone; the last within the FP8 caches' rounding of theirs) and its greedy tokens but at
near-ties; padding is neither stored nor
attended; the options the paged caches cannot serve are refused by name. The indexer's top-k
covers every visible block here (``index_topk`` 64 over at most 48 blocks), as in
``test_transformers_model.py``."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from dsv4_compile.generation import random_prompts  # noqa: E402
from dsv4_compile.integrations.transformers import TransformersDSV4, random_hf_model  # noqa: E402
from dsv4_compile.integrations.transformers_cache import PagedCache  # noqa: E402
from dsv4_compile.models import CacheConfig  # noqa: E402
from dsv4_compile.tolerances import reordered_atol, rerounded_atol  # noqa: E402
from helpers import near_tie_margin  # noqa: E402
from test_transformers_bridge import hf_config  # noqa: E402

CACHE = CacheConfig(max_requests=4, max_seq_len=512, page_size=256, kv_format="v4", index_format="fp32")
LENGTHS = (5, 37, 150)
NEW = 6
PAD = 0


@pytest.fixture(scope="module")
def models():
    theirs = random_hf_model(hf_config(index_topk=64))
    return theirs, TransformersDSV4(copy.deepcopy(theirs), CACHE)


def prompts() -> list[list[int]]:
    return random_prompts(256, LENGTHS, seed=3)


def padded(rows: list[list[int]], side: str = "left", pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``rows`` padded to the longest on ``side`` with ``pad``."""
    width = max(map(len, rows))
    ids, mask = [], []
    for row in rows:
        fill = width - len(row)
        ids.append([pad] * fill + row if side == "left" else row + [pad] * fill)
        mask.append([0] * fill + [1] * len(row) if side == "left" else [1] * len(row) + [0] * fill)
    return torch.tensor(ids), torch.tensor(mask)


def ours_generate(ours, ids, mask, **options):
    """Their ``generate()`` on the switched model: ``NEW`` greedy tokens padded with ``PAD`` unless
    ``options`` say otherwise."""
    options = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, **options}
    return ours.hf.generate(input_ids=ids, attention_mask=mask, **options)


def their_greedy(theirs, prompt: list[int], new: int = NEW) -> tuple[list[int], list[torch.Tensor]]:
    """Their eager model's greedy tokens of one prompt alone, and its logits of every step."""
    out = theirs.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=PAD,
                          return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


def assert_their_tokens_but_at_near_ties(theirs, rows: list[list[int]], got: torch.Tensor) -> None:
    """Each row of ``got`` (new tokens) is their greedy continuation of its prompt up to the first
    difference, which must be a near-tie in their logits at that step (:func:`near_tie_margin` of
    ``rerounded_atol``); the rest of that row continues another sequence and is not compared."""
    for r, prompt in enumerate(rows):
        want, logits = their_greedy(theirs, prompt, got.shape[1])
        mine = got[r].tolist()
        for step, (a, b) in enumerate(zip(want, mine)):
            if a != b:
                gap = (logits[step].max() - logits[step][b]).item()
                assert gap <= near_tie_margin([logits[step]], rerounded_atol), (
                    f"row {r}, step {step}: token {b} lies {gap:.3g} below their top logit ({a})")
                break


@pytest.mark.parametrize("side", ["left", "right"])
def test_forward_gives_each_prompts_logits(models, side):
    """A padded batch without a cache: the logits of every real token are those of the prompt
    alone through the same model (the same computation in other GEMM groupings:
    ``reordered_atol``), and each prompt's last logits are their model's within the FP8 caches'
    rounding (``rerounded_atol``, as ``test_transformers_model.py`` compares steps). Over every
    position of the 150-token prompt, ours and theirs differ by up to 15% of the largest logit
    (4 of its 38,400 logits past the FP8 step's 12.5%), the batch or the prompt alone alike."""
    theirs, ours = models
    rows = prompts()
    ids, mask = padded(rows, side)
    with torch.no_grad():
        logits = ours.hf(ids, attention_mask=mask).logits
        for r, prompt in enumerate(rows):
            alone = ours.hf(torch.tensor([prompt])).logits[0]
            got = logits[r][mask[r].bool()]
            torch.testing.assert_close(got, alone, atol=reordered_atol(alone), rtol=0, msg=lambda m: f"row {r}: {m}")
            want = theirs(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(got[-1], want, atol=rerounded_atol(want), rtol=0, msg=lambda m: f"row {r}: {m}")


def test_generate_gives_their_greedy_tokens_but_at_near_ties(models):
    theirs, ours = models
    rows = prompts()
    ids, mask = padded(rows)
    with torch.no_grad():
        out = ours_generate(ours, ids, mask)
    assert out.shape == (len(rows), ids.shape[1] + NEW)
    assert torch.equal(out[:, : ids.shape[1]], ids)
    assert_their_tokens_but_at_near_ties(theirs, rows, out[:, ids.shape[1]:])


def kept_state(ours) -> dict[str, torch.Tensor]:
    """Every cache and compressor state of our layers, but the overlapping compressors' scratch
    ring row (``CacheConfig.max_requests``: where writes that are not kept land, in any order)."""
    state = {}
    for i, layer in enumerate(ours.hf.model.layers):
        for name, buf in layer.self_attn.attn.named_buffers():
            if name.endswith(("state_kv", "state_score")):
                buf = buf[: buf.shape[0] // (CACHE.max_requests + 1) * CACHE.max_requests]
            if "cache" in name or "state" in name:
                state[f"{i}.{name}"] = buf.clone()
    return state


def test_padding_is_neither_stored_nor_attended(models):
    """Left- or right-padded, with pad id 0 or a poisoned one (a token the prompts hold): the
    same logits of every real token and the same cache bytes after the prefill, bit for bit; and
    left-padded, the same new tokens (``generate()`` continues from each row's last column, a
    padding token where padded on the right: transformers' own rule, which it warns of)."""
    _, ours = models
    rows = prompts()
    runs = []
    for side, pad in (("left", PAD), ("left", rows[2][7]), ("right", rows[2][7])):
        ids, mask = padded(rows, side, pad)
        with torch.no_grad():
            logits = ours.hf(ids, attention_mask=mask).logits[mask.bool()]
            state = kept_state(ours)
            out = ours_generate(ours, ids, mask, pad_token_id=pad)
        runs.append((logits, state, out[:, ids.shape[1]:]))
    (logits, state, tokens), others = runs[0], runs[1:]
    assert len(state) >= 9, sorted(state)  # the window, compressed and index caches and the compressor states
    for other_logits, other_state, _ in others:
        assert torch.equal(other_logits, logits)
        assert [k for k, v in state.items() if not torch.equal(other_state[k], v)] == []
    assert torch.equal(others[0][2], tokens)  # left-padded with the poisoned pad


def test_sampling_runs_and_top_1_sampling_is_greedy(models):
    _, ours = models
    ids, mask = padded(prompts())
    with torch.no_grad():
        greedy = ours_generate(ours, ids, mask)
        top1 = ours_generate(ours, ids, mask, do_sample=True, top_k=1)
        torch.manual_seed(0)  # 2 prompts x 2 sequences: the cache's 4 request slots
        sampled = ours_generate(ours, ids[:2], mask[:2], do_sample=True, temperature=1.5, num_return_sequences=2)
    assert torch.equal(top1, greedy)
    assert sampled.shape == (4, ids.shape[1] + NEW)
    assert bool(((sampled >= 0) & (sampled < 256)).all())


def test_eos_stops_a_row_and_scores_are_returned(models):
    _, ours = models
    ids, mask = padded(prompts())
    with torch.no_grad():
        free = ours_generate(ours, ids, mask)[:, ids.shape[1]:]
        eos = int(free[0, 1])
        out = ours_generate(ours, ids, mask, eos_token_id=eos, return_dict_in_generate=True, output_scores=True)
    new = out.sequences[:, ids.shape[1]:]
    for r in range(len(LENGTHS)):
        row, want = new[r].tolist(), free[r].tolist()
        stop = want.index(eos) + 1 if eos in want else len(want)
        assert row[:stop] == want[:stop], r
        assert all(t == PAD for t in row[stop:]), r
    assert len(out.scores) == new.shape[1] and out.scores[0].shape == (len(LENGTHS), 256)


def test_chunked_prefill_gives_the_same_tokens_but_at_near_ties(models):
    theirs, ours = models
    rows = prompts()
    ids, mask = padded(rows)
    with torch.no_grad():
        out = ours_generate(ours, ids, mask, prefill_chunk_size=64)
    assert_their_tokens_but_at_near_ties(theirs, rows, out[:, ids.shape[1]:])


def test_the_cache_counts_columns_and_goes_stale(models):
    _, ours = models
    ids, mask = padded(prompts())
    with torch.no_grad():
        out = ours.hf(ids, attention_mask=mask, use_cache=True)
        cache = next(v for k, v in out.items() if isinstance(v, PagedCache))
        assert cache.get_seq_length() == ids.shape[1]
        assert cache.lengths == list(LENGTHS)
        step = torch.tensor([[1], [2], [3]])
        ours.hf(step, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1), cache=cache)
        assert cache.get_seq_length() == ids.shape[1] + 1 and cache.lengths == [n + 1 for n in LENGTHS]
        ours.hf(step)  # a forward without a cache takes the model's caches
        with pytest.raises(ValueError, match="this PagedCache is stale"):
            ours.hf(step, cache=cache)
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.lengths == []


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_beams=2), r"beam_search \(num_beams > 1\) is not supported .*\(num_beams=1"),
        # (some transformers versions refuse it first: "assisted generation is not supported with stateful models")
        (dict(prompt_lookup_num_tokens=2), r"assisted.generation (\(assistant_model or prompt_lookup_num_tokens\) )?is not"),
        (dict(cache_implementation="static"), r"cache_implementation must be None .* got 'static'"),
    ],
)
def test_unsupported_generate_options_are_named(models, options, message):
    _, ours = models
    ids, mask = padded(prompts())
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        ours_generate(ours, ids, mask, max_new_tokens=2, **options)


def test_unsupported_cache_operations_and_inputs_are_named(models):
    _, ours = models
    cache = PagedCache(ours)
    with pytest.raises(ValueError, match=r"beam search \(num_beams > 1\) is not supported"):
        cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(ValueError, match="rolling the cache back .* is not supported"):
        cache.crop(3)
    with torch.no_grad(), pytest.raises(ValueError, match=r"batch size must be <= 4 \(CacheConfig.max_requests"):
        ours.hf(torch.zeros(5, 3, dtype=torch.long))
    with torch.no_grad(), pytest.raises(ValueError, match="inputs_embeds is not supported"):
        ours.hf(inputs_embeds=torch.zeros(1, 3, 128))
    with torch.no_grad(), pytest.raises(ValueError, match=r"input_ids must be in \[0, 256\) \(the vocabulary\)"):
        ours.hf(torch.tensor([[1, 300]]))


def test_compiled_forward_gives_the_same_tokens_without_recompiles(models):
    """``hf_model.forward = torch.compile(hf_model.forward)`` (``aot_eager``: Dynamo and
    AOTAutograd over the ops' fakes): the eager tokens; 4 graphs over the first ``generate()``
    (each forward is traced in two graphs around the host-side hook that packs the step: one
    shape for the prefill, one for every decode step), none over a longer second call."""
    _, ours = models
    ids, mask = padded(prompts())
    graphs = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counted(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    forward = ours.hf.forward
    torch._dynamo.reset()
    with torch.no_grad():
        eager = ours_generate(ours, ids, mask)
        ours.hf.forward = torch.compile(forward, backend=counted)
        try:
            compiled = ours_generate(ours, ids, mask)
            first = len(graphs)
            longer = ours_generate(ours, ids, mask, max_new_tokens=2 * NEW)
        finally:
            ours.hf.forward = forward
    assert torch.equal(compiled, eager)
    assert torch.equal(longer[:, : eager.shape[1]], eager)
    assert (first, len(graphs)) == (4, 4), (first, len(graphs))
