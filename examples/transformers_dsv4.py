"""transformers' DeepSeek V4 both ways: its own eager model, and the same model with our attention.

Builds a small transformers ``DeepseekV4ForCausalLM`` with random weights (one layer of each kind:
:func:`~dsv4_compile.integrations.transformers.tiny_hf_config`) on CUDA if present, else CPU, and
runs greedy generation for three prompts of different lengths:

* **transformers**: their eager model in float32 with their own cache, one request at a time
  (their compressors pool every token they are given, so a padded batch would pool the padding);
* **ours**: the same model with its attention layers replaced by ours
  (:class:`~dsv4_compile.integrations.transformers.TransformersDSV4`: paged FP8 caches, the
  ``dsv4`` ops), the three requests in one step, eagerly and compiled
  (``torch.compile(fullgraph=True)``, default mode: transformers' MoE with float32 weights syncs
  with the host, so CUDA graphs cannot capture the step; with bf16 weights it need not), fed
  transformers' tokens (so a near-tie does not send the runs apart).

Reports the largest logit difference against transformers (eager and compiled) next to the
tolerance the tests use (``rerounded_atol``: one FP8 step of the largest logit), the token
agreement (ours' greedy choices against theirs at every step, and for a differing one how far
below their top logit ours lies), the peak memory of each way (prefill and decode; ours
includes its caches, allocated up front) and the time per decode step (theirs: the three
requests one after another).

    python examples/transformers_dsv4.py [--device cpu|cuda] [--steps 8] [--kv-format v4]
        [--index-topk 64] [--index-format fp8|fp4|fp32] [--json]

``--index-topk``: the ratio-4 layers' indexer picks that many compressed blocks. The default, 64,
covers every block these prompts reach, so both models attend to the same keys; with fewer (DSV4's
ratio is 512 of up to 256k blocks) the indexers choose, and ours (scoring keys from its
``--index-format`` cache, lower block first on exact ties) may choose another block at a near-tie
of their scores: another key, not a rounding, so the logits may then differ by more than the
FP8-step tolerance.

Peak memory: on CUDA the allocator's peak above what was allocated before the run; on CPU the
largest sum of live tensor storages created during the run, tracked op by op
(:class:`PeakTensorBytes`: eager runs only, so the compiled run reports none). The first compiled
step includes compilation and is left out of its time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dsv4_compile as d4
from dsv4_compile import layout
from dsv4_compile.generation import choice_margins, random_prompts
from dsv4_compile.integrations.transformers import TransformersDSV4, hf_cached_forward, random_hf_model, tiny_hf_config
from dsv4_compile.models import CacheConfig
from dsv4_compile.models.model import state_buffers
from dsv4_compile.tolerances import rerounded_atol

from generate import PROMPT_LENGTHS, Timed, run  # this directory's example


class PeakTensorBytes(TorchDispatchMode):
    """The peak of the bytes held by tensor storages created inside the mode (``peak``), their
    liveness checked after every op; a CPU stand-in for CUDA's allocator statistics."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in inputs and ref not in self.live:
                    self.live[ref] = t.untyped_storage().nbytes()
                    self.now += self.live[ref]
        self.peak = max(self.peak, self.now)
        for ref in [r for r in self.live if r.expired()]:
            self.now -= self.live.pop(ref)
        return out


class Peak:
    """``with Peak(device) as p: ...``; then ``p.bytes``: the run's peak memory above its start."""

    def __init__(self, device: torch.device, track_cpu: bool = True):
        self.device, self.mode, self.bytes = device, None, None
        self.track_cpu = track_cpu

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        elif self.track_cpu:
            self.mode = PeakTensorBytes().__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.start
        elif self.mode is not None:
            self.mode.__exit__(*exc)
            self.bytes = self.mode.peak


@torch.no_grad()
def run_transformers(model, prompts, steps: int, device) -> tuple[list[list[int]], list[torch.Tensor], list[float]]:
    """Their greedy generation, one request at a time with their cache: each request's tokens
    (``steps + 1``: the prefill's, then one per decode step), the logits of every step
    (``[requests, vocab]``, step 0 the prefill's) and the ms of each decode step (the requests'
    decode calls of that step summed)."""
    decode = Timed(lambda input_ids, cache: hf_cached_forward(model, input_ids, cache), device)
    tokens, logits = [], [[] for _ in range(steps + 1)]
    for prompt in prompts:
        out, cache = hf_cached_forward(model, torch.tensor([prompt], device=device))
        step_logits = out[0, -1].float()
        chosen = [int(step_logits.argmax())]
        logits[0].append(step_logits)
        for step in range(1, steps + 1):
            out, cache = decode(input_ids=torch.tensor([[chosen[-1]]], device=device), cache=cache)
            step_logits = out[0, -1].float()
            logits[step].append(step_logits)
            chosen.append(int(step_logits.argmax()))
        tokens.append(chosen)
    ms = [sum(decode.ms[r * steps + s] for r in range(len(prompts))) for s in range(steps)]
    return tokens, [torch.stack(s) for s in logits], ms


@torch.no_grad()
def run_ours(model: TransformersDSV4, step, prompts, steps: int, device, follow) -> tuple[list[list[int]], list, list[float]]:
    """Our greedy generation, the prefill through ``model`` and the decode steps through ``step``
    (the model or its compiled form), fed ``follow``'s tokens: the greedy tokens, the logits of
    every step and the ms of each decode step."""
    decode = Timed(step, device, clone=True)
    tokens, logits = run(model, decode, prompts, steps, device, follow=follow)
    return tokens, logits, decode.ms


def cache_bytes(model: TransformersDSV4) -> int:
    """The bytes of our attention layers' caches and compressor states."""
    return sum(b.numel() * b.element_size() for layer in model.hf.model.layers
               for b in state_buffers(layer.self_attn.attn).values())


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8, help="decode steps (>= 2)")
    parser.add_argument("--kv-format", default="v4", choices=[n for n, f in layout.FORMATS.items() if f.values != "fp4"],
                        help="our caches' format")
    parser.add_argument("--index-topk", type=int, default=64,
                        help="the ratio-4 layers' top-k blocks (64: every block of these prompts)")
    parser.add_argument("--index-format", default="fp8", choices=list(layout.INDEX_FORMATS),
                        help="our indexer key cache's format")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    device, steps = torch.device(args.device), max(args.steps, 2)

    theirs = random_hf_model(tiny_hf_config(index_topk=args.index_topk), seed=0, device=device)
    prompts = random_prompts(theirs.config.vocab_size, PROMPT_LENGTHS)
    run_transformers(theirs, prompts[:1], 1, device)  # warm-up
    with Peak(device) as their_peak:
        their_tokens, their_logits, their_ms = run_transformers(theirs, prompts, steps, device)

    cache = CacheConfig(max_requests=len(prompts), max_seq_len=256, page_size=128, kv_format=args.kv_format,
                        index_format=args.index_format)
    ours = TransformersDSV4(copy.deepcopy(theirs), cache)
    del theirs
    run_ours(ours, ours, prompts[:1], 1, device, None)  # warm-up
    with Peak(device) as our_peak:
        tokens, logits, eager_ms = run_ours(ours, ours, prompts, steps, device, their_tokens)
    # not "reduce-overhead": transformers' experts with float32 weights run a host loop
    # (transformers::grouped_mm_fallback reads its offsets with .tolist()), which a CUDA graph cannot capture
    mode = "default"
    compiled = torch.compile(ours, fullgraph=True, mode=mode)
    with Peak(device, track_cpu=False) as compiled_peak:
        compiled_tokens, compiled_logits, compiled_ms = run_ours(ours, compiled, prompts, steps, device, their_tokens)

    atol = max(rerounded_atol(w) for w in their_logits)
    scale = max(w.abs().max().item() for w in their_logits)

    def err(got):
        return max((g - w).abs().max().item() for g, w in zip(got, their_logits))

    def agreement(got_tokens):
        pairs = [(a, b) for mine, want in zip(got_tokens, their_tokens) for a, b in zip(mine, want)]
        return sum(a == b for a, b in pairs) / len(pairs)

    report = {
        "device": str(device),
        "kv_formats": ours.cache.cache_formats(),
        "steps": steps,
        "requests": len(prompts),
        "logit_scale": scale,
        "tolerance_rerounded_atol": atol,
        "max_abs_err_eager": err(logits),
        "max_abs_err_compiled": err(compiled_logits),
        "token_agreement_eager": agreement(tokens),
        "token_agreement_compiled": agreement(compiled_tokens),
        # where our choice differs: how far below transformers' top logit it lies (a near-tie if small)
        "choice_margin_eager": max(choice_margins(their_logits, their_tokens, tokens), default=0.0),
        "choice_margin_compiled": max(choice_margins(their_logits, their_tokens, compiled_tokens), default=0.0),
        "transformers_peak_bytes": their_peak.bytes,
        # our caches were allocated before the runs (so not in their peaks): added
        "ours_peak_bytes": our_peak.bytes + cache_bytes(ours),
        "ours_compiled_peak_bytes": None if compiled_peak.bytes is None else compiled_peak.bytes + cache_bytes(ours),
        "ours_cache_bytes": cache_bytes(ours),
        "transformers_ms_per_decode_step": statistics.median(their_ms),
        "ours_eager_ms_per_decode_step": statistics.median(eager_ms),
        "ours_compiled_ms_per_decode_step": statistics.median(compiled_ms[1:]),  # step 1 compiles
        "compiled_mode": mode,
        "providers": d4.providers(device),
    }
    if args.json:
        print(json.dumps(report))
    else:
        width = max(map(len, report))
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
        for prompt, mine, want in zip(prompts, tokens, their_tokens):
            print(f"  prompt of {len(prompt):>3} tokens -> ours {mine} / transformers {want}")
    return report


if __name__ == "__main__":
    main()
