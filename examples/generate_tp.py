"""examples/generate.py with the model tensor-parallel over N processes (``torch.distributed``).

    torchrun --nproc-per-node N examples/generate_tp.py [--device cpu|cuda] [--steps 8]
        [--kv-format v4] [--c4-kv-format F] [--chunk N] [--json] [--dump DIR]

Each rank holds ``1/N`` of the query heads, output groups, indexer heads and MLP width
(:mod:`dsv4_compile.models.parallel`) and the same weights as the single-process model (same
seed); the attention and MLP outputs (and the indexer's block logits) are all-reduced with
functional collectives, which stay inside the one compiled graph. Backend: NCCL on CUDA (rank
``r`` on GPU ``LOCAL_RANK``), gloo on CPU.

Each rank prints the keys of ``examples/generate.py`` plus ``rank``, ``world_size``, the
all-reduces in the decode step's graph (``all_reduce_count``), and its agreement with the
unsharded model run in the same process and fed the same tokens (teacher forcing, so that one
near-tie does not send the two generations apart): ``max_abs_err_vs_tp1`` (eager logits of every
step, tensor-parallel vs one rank), ``tokens_equal_tp1`` (the same greedy choices) and, where a choice
differs, ``tp1_margin_where_tokens_differ``: how far below the unsharded model's top logit the
tensor-parallel choice lies (a near-tie that bf16 rounding flips has a margin within the logits'
error). ``--dump DIR``: each rank also saves its eager logits of every step and its tokens to
``DIR/rank{r}.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import dsv4_compile as d4
from dsv4_compile.generation import choice_margins, random_prompts
from dsv4_compile.models.parallel import all_reduces_in, torchrun_group
from generate import PROMPT_LENGTHS, make_model, measure, parser, run  # this directory's example


def main() -> dict:
    p = parser()
    p.add_argument("--dump", help="save each rank's eager logits and tokens to DIR/rank{r}.pt")
    args = p.parse_args()
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun: torchrun --nproc-per-node N examples/generate_tp.py")
    with torchrun_group(args.device) as (device, tp):
        return _run(args, device, tp)


def _run(args, device, tp) -> dict:
    steps = max(args.steps, 2)
    model = make_model(args.kv_format, device, tp=tp, c4_kv_format=args.c4_kv_format, index_format=args.index_format)
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENGTHS)
    measured, details = measure(model, prompts, steps, device, args.chunk)

    single = make_model(args.kv_format, device, c4_kv_format=args.c4_kv_format, index_format=args.index_format)  # the unsharded model, same seed, fed the same tokens
    with torch.no_grad():
        tp1_tokens, tp1_logits = run(single, single, prompts, steps, device, args.chunk, follow=details["tokens"])
    margins = choice_margins(tp1_logits, tp1_tokens, details["tokens"])
    report = {
        "rank": tp.rank,
        "world_size": tp.size,
        "device": str(device),
        "kv_formats": model.cache.cache_formats(),
        "prefill_chunk": args.chunk,
        **measured,
        "all_reduce_count": all_reduces_in(details["graphs"]),
        "tokens_equal_compiled": details["tokens_match"],
        "compiled_margin_where_tokens_differ": details["compiled_margin"],
        "tokens_equal_tp1": details["tokens"] == tp1_tokens,
        "tp1_margin_where_tokens_differ": max(margins, default=0.0),
        "max_abs_err_vs_tp1": max((a - b).abs().max().item() for a, b in zip(details["logits"], tp1_logits)),
        "providers": d4.providers(device),
        "tokens": details["tokens"],
    }
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        torch.save({"logits": [l.cpu() for l in details["logits"]], "tokens": details["tokens"]},
                   Path(args.dump) / f"rank{tp.rank}.pt")
    text = json.dumps(report) if args.json else "\n".join(f"[rank {tp.rank}] {k}: {v}" for k, v in report.items())
    # one write of the report with its newline: the ranks share stdout, and a report printed in
    # several writes can be interleaved with another rank's (a pipe takes a write of <= 4 KB whole)
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())
    return report


if __name__ == "__main__":
    main()
