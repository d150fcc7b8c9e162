"""A step's token ids, positions and request slots are checked before any kernel runs
(:class:`dsv4_compile.generation.StepLimits`): on the host in the step builders of
:mod:`dsv4_compile.generation`, in the model's forward in checked mode; and a cache larger than the
model's RoPE tables is refused when the model is built. An error names the argument, the bound and
the value, and leaves every cache as it was."""

from __future__ import annotations

import pytest
import torch

import dsv4_compile as d4
from dsv4_compile.generation import Batch, StepLimits, decode_inputs, generate, prefill_prompts, step_inputs, step_limits
from dsv4_compile.models import CacheConfig, DeepseekV4Attention, DeepseekV4Model, tiny_config

CFG = tiny_config(sliding_window=16)  # vocabulary 256, max_position_embeddings 4096
CACHE = CacheConfig(max_requests=2, max_seq_len=512, page_size=256)


def make_model(device="cpu") -> DeepseekV4Model:
    return DeepseekV4Model(CFG, CACHE, seed=0, device=device)


def states(model) -> dict[str, torch.Tensor]:
    return {name: buf.clone() for name, buf in model.state_buffers().items()}


def assert_states_equal(model, before) -> None:
    for name, buf in model.state_buffers().items():
        assert torch.equal(buf, before[name]), name


@pytest.mark.parametrize("build", [DeepseekV4Model, lambda config, cache: DeepseekV4Attention(config, 4, cache)])
def test_a_cache_past_the_rope_tables_is_refused_at_build(build):
    with pytest.raises(ValueError, match=r"CacheConfig.max_seq_len \(8192\) must be at most the model's "
                                         r"max_position_embeddings \(4096\)"):
        build(CFG, CacheConfig(max_requests=1, max_seq_len=8192))
    build(CFG, CacheConfig(max_requests=1, max_seq_len=4096))  # the tables' size is accepted


def test_the_model_and_a_compiled_model_carry_their_limits():
    model = make_model()
    assert model.step_limits == StepLimits(vocab_size=256, max_position_embeddings=4096, max_seq_len=512, max_requests=2)
    assert model.step_limits.max_position == 512
    assert step_limits(torch.compile(model)) is model.step_limits  # torch.compile forwards attributes
    assert step_limits(lambda **inputs: None) is None


LIMITS = StepLimits(vocab_size=256, max_position_embeddings=4096, max_seq_len=512, max_requests=2)
BOUND = r"below 512 \(max_position_embeddings 4096, CacheConfig.max_seq_len 512: the smaller\)"


@pytest.mark.parametrize(
    "chunks, starts, slots, message",
    [
        ([[1, 2], [3, 256]], [0, 0], None, r"input_ids must be in \[0, 256\) \(the vocabulary\), got 256 in batch row 1"),
        ([[-1]], [0], None, r"input_ids must be in \[0, 256\) \(the vocabulary\), got -1 in batch row 0"),
        ([[1], [1]], [7, 512], None, rf"positions must be >= 0 and {BOUND}, got 512 in batch row 1"),
        ([[1] * 10], [505], None, rf"positions must be >= 0 and {BOUND}, got 514 in batch row 0"),
        ([[1]], [-3], None, rf"positions must be >= 0 and {BOUND}, got -3 in batch row 0"),
        ([[1], [1]], [0, 0], [0, 2], r"req_slots must be in \[0, 2\) \(CacheConfig.max_requests\), got 2 in batch row 1"),
    ],
)
def test_step_builders_name_the_input_past_its_bound(chunks, starts, slots, message):
    with pytest.raises(ValueError, match=message):
        step_inputs(chunks, starts, "cpu", slots=slots, limits=LIMITS)


def test_the_last_position_of_the_cache_is_accepted():
    inputs = step_inputs([[255] * 12], [500], "cpu", slots=[1], limits=LIMITS)
    assert inputs["positions"][-1].item() == 511


def test_generation_stops_before_a_decode_past_the_cache_and_writes_nothing():
    """A prompt of 510 tokens: decode steps at positions 510 and 511 run, the one at 512 is
    refused on the host; the caches hold what the steps before it wrote."""
    model = make_model()
    prompt = torch.randint(0, 256, (510,), generator=torch.Generator().manual_seed(0)).tolist()
    seen = []
    with pytest.raises(ValueError, match=rf"positions must be >= 0 and {BOUND}, got 512 in batch row 0"):
        generate(model, model, [prompt], 5, "cpu", on_step=lambda step, logits: seen.append(states(model)))
    assert len(seen) == 3  # the prefill's logits, then decodes at 510 and 511
    assert_states_equal(model, seen[-1])


def test_a_prompt_with_an_id_past_the_vocabulary_is_refused_before_its_prefill():
    model = make_model()
    before = states(model)
    for chunk in (None, 4):
        with pytest.raises(ValueError, match=r"input_ids must be in \[0, 256\) \(the vocabulary\), got 300 in batch row 1"):
            prefill_prompts(model, [[1, 2, 3], [4, 300]], "cpu", chunk)
    assert_states_equal(model, before)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(input_ids=torch.tensor([1, 999])), r"input_ids must be in \[0, 256\) \(the vocabulary\), got 999 at index 1"),
        (dict(positions=torch.tensor([600, 10])), rf"positions must be >= 0 and {BOUND}, got 600 at index 0"),
        (dict(req_slots=torch.tensor([0, 5])), r"req_slots must be in \[0, 2\) \(CacheConfig.max_requests\), got 5 at index 1"),
    ],
)
def test_the_models_forward_checks_its_tensors_in_checked_mode(change, message):
    model = make_model()
    before = states(model)
    inputs = {**decode_inputs(Batch([[1] * 8, [2] * 11]), "cpu"), **change}
    with d4.checked(), torch.no_grad(), pytest.raises(ValueError, match=message):
        model(**inputs, mode="decode")
    assert_states_equal(model, before)


@pytest.mark.cuda
def test_cuda_the_process_stays_usable_after_a_refused_step():
    """A decode past the cache and a token past the vocabulary are refused on the host: no
    device-side assert poisons the CUDA context, and the next steps run."""
    model = make_model("cuda")
    prompt = torch.randint(0, 256, (511,), generator=torch.Generator().manual_seed(0)).tolist()
    with pytest.raises(ValueError, match=rf"positions must be >= 0 and {BOUND}, got 512 in batch row 0"):
        generate(model, model, [prompt], 3, "cuda")
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 256\) \(the vocabulary\), got 256"):
        prefill_prompts(model, [[256]], "cuda")
    model.reset_caches()
    tokens = generate(model, model, [[5, 6, 7], [8] * 40], 4, "cuda")
    torch.cuda.synchronize()
    assert [len(t) for t in tokens] == [5, 5]
