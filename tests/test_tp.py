"""Tensor parallelism (dsv4_compile.models.parallel): the shards, and the model over two processes.

The two-process test launches ``examples/generate_tp.py`` with ``torchrun`` (gloo on CPU, NCCL on
two GPUs) and compares each rank's logits with the unsharded model run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_compile.generation import random_prompts
from dsv4_compile.models import CacheConfig, DeepseekV4Model, generate, tiny_config
from dsv4_compile.models.parallel import SINGLE, TensorParallel
from dsv4_compile.tolerances import rerounded_atol
from helpers import assert_same_choices_but_near_ties, assert_steps_close, near_tie_margin

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "generate_tp.py"
PROMPT_LENGTHS = (5, 37, 150)  # examples/generate.py's
CACHE = CacheConfig(max_requests=4, max_seq_len=512)
STEPS = 4


def test_shards_of_every_rank_make_the_unsharded_weights():
    """Rank r holds rows/columns r of each sharded weight; concatenated they are the weights of
    the unsharded model of the same seed, and the replicated ones are equal on every rank."""
    config = tiny_config()
    full = dict(DeepseekV4Model(config, CACHE, seed=0).named_parameters())
    ranks = [dict(DeepseekV4Model(config, CACHE, seed=0, tp=TensorParallel(r, 2, group="g")).named_parameters())
             for r in range(2)]
    sharded = 0
    for name, want in full.items():
        parts = [rank[name] for rank in ranks]
        if parts[0].shape == want.shape:
            for part in parts:
                torch.testing.assert_close(part, want, atol=0, rtol=0, msg=name)
            continue
        dim = next(d for d, (a, b) in enumerate(zip(parts[0].shape, want.shape)) if a != b)
        torch.testing.assert_close(torch.cat(parts, dim), want, atol=0, rtol=0, msg=name)
        sharded += 1
    # per layer: wq_b, wo_a, wo_b, attn_sink, MLP gate/up/down; the ratio-4 indexer's wq_b, weights_proj
    assert sharded == 7 * config.num_hidden_layers + 2


@pytest.mark.parametrize(
    "overrides, name",
    [
        (dict(num_attention_heads=3, o_groups=1), "num_attention_heads"),
        (dict(o_groups=1), "o_groups"),
        (dict(index_n_heads=3), "index_n_heads"),
        (dict(intermediate_size=129), "intermediate_size"),
    ],
)
def test_sizes_the_ranks_cannot_split_are_rejected(overrides, name):
    with pytest.raises(ValueError, match=f"{name} .* must be a multiple of the tensor-parallel size \\(2\\)"):
        DeepseekV4Model(tiny_config(**overrides), CACHE, tp=TensorParallel(0, 2, group="g"))


def test_tensor_parallel_arguments_are_checked():
    with pytest.raises(ValueError, match="rank must be in \\[0, size\\)"):
        TensorParallel(2, 2, group="g")
    with pytest.raises(ValueError, match="needs a process group, got None"):
        TensorParallel(0, 2)
    assert SINGLE.all_reduce(x := torch.ones(2)) is x


def run_tp(tmp_path: Path, device: str, nproc: int = 2) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(EXAMPLE), "--device", device, "--steps", str(STEPS), "--json", "--dump", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == list(range(nproc)), done.stdout
    return reports


def check_against_unsharded(reports: list[dict], tmp_path: Path, device: str) -> None:
    """Every rank: one graph, no break, the all-reduces inside it; and the unsharded model, fed
    the same tokens, gives its logits within the FP8 step of a cached value (the ranks round their
    partial sums to bf16 before the all-reduce, so the residual stream differs in its last bits
    and some values cross the caches' rounding boundaries: ``tolerances.FP8_STEP_SHARE``; a wrong
    shard or a missing all-reduce moves the logits by O(1)) and its greedy choices, except where
    two logits lie within twice that of each other (near-ties)."""
    config = tiny_config()
    prompts = random_prompts(config.vocab_size, PROMPT_LENGTHS)
    model = DeepseekV4Model(config, CACHE, seed=0, device=device)
    # attention and MLP of each layer, and the ratio-4 layer's indexer
    all_reduces = 2 * config.num_hidden_layers + config.compress_ratios.count(4)
    for report in reports:
        assert (report["graph_count"], report["graph_break_count"]) == (1, 0), report
        assert report["all_reduce_count"] == all_reduces, report
        assert report["world_size"] == len(reports)
        dumped = torch.load(tmp_path / f"rank{report['rank']}.pt")
        logits = []
        with torch.no_grad():
            tokens = generate(model, model, prompts, STEPS, device, follow=dumped["tokens"],
                              on_step=lambda s, l: logits.append(l))
        assert len(logits) == STEPS + 1, len(logits)  # the prefill and every decode step
        assert_steps_close(dumped["logits"], [step.cpu() for step in logits], rerounded_atol)
        # the rank's compiled run against its eager one: skipped roundings too (0 if equal)
        assert report["compiled_margin_where_tokens_differ"] <= near_tie_margin(logits, rerounded_atol), report
        assert_same_choices_but_near_ties(logits, tokens, dumped["tokens"], rerounded_atol)


def test_two_cpu_ranks_over_gloo_match_the_unsharded_model(tmp_path):
    reports = run_tp(tmp_path, "cpu")
    check_against_unsharded(reports, tmp_path, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_over_nccl_match_the_unsharded_model(tmp_path):
    reports = run_tp(tmp_path, "cuda")
    check_against_unsharded(reports, tmp_path, "cuda")
