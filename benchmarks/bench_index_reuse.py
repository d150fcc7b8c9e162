"""``DeepseekV4Config.index_reuse``: what reusing a selection across ratio-4 layers costs and gains.

    PYTHONPATH=. python benchmarks/bench_index_reuse.py [--gain-contexts 131072 1048576]
        [--cost-context 32768] [--chunk 8192] [--json F]          # CUDA; --quick: any device

The model: 4 layers at DSV4-Flash widths, ratios (0, 4, 4, 128), a 32000-token vocabulary, FP8
indexer keys, random weights (seed 0), one request of ``context`` random tokens prefilled eagerly in
chunks of ``--chunk`` tokens.

* ``cost`` (one prefill at ``--cost-context``, one model): the default model, and the same model
  with layer 2 made to attend layer 1's selection in every chunk (what ``index_reuse=2`` runs; its
  own indexer still scores, to compare). ``agreement``: the share of layer 2's own top-k that
  layer 1's selection holds, over the rows that see more than ``index_topk`` blocks (the two
  layers' random indexer weights are independent, so this is the floor a trained model starts
  from: ``index_topk`` over the visible blocks, ~k / blocks); ``logit_error``: each chunk's
  last-token logits, largest difference over the largest magnitude; ``same_argmax``: the share of
  chunks whose greedy token is unchanged.
* ``gain`` (each context, ``index_reuse`` 1 and 2, a model each): the prefill's time (after a
  warm-up of two chunks) and the time saved.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dsv4_compile.generation import prefill_chunks, random_prompts, step_inputs
from dsv4_compile.models import CacheConfig, DeepseekV4Config, DeepseekV4Model, tiny_config

RATIOS = (0, 4, 4, 128)


def build(context: int, index_reuse: int, quick: bool, device) -> DeepseekV4Model:
    if quick:
        config = tiny_config(compress_ratios=RATIOS, num_hidden_layers=4, index_reuse=index_reuse,
                             max_position_embeddings=max(4096, context))
    else:
        config = DeepseekV4Config(num_hidden_layers=4, vocab_size=32000, compress_ratios=RATIOS,
                                  index_reuse=index_reuse)
    cache = CacheConfig(max_requests=1, max_seq_len=context, page_size=256, index_format="fp8")
    return DeepseekV4Model(config, cache, seed=0, device=device)


def chunked(model, prompt, chunk, device) -> list[torch.Tensor]:
    """Each chunk's last-token logits ``[vocab]`` of one prompt's chunked prefill."""
    out = []
    for rows in prefill_chunks([prompt], chunk):
        (_, start, count), = rows
        out.append(model(**step_inputs([prompt[start:start + count]], [start], device), mode="prefill")[0])
    return out


def cost(context: int, chunk: int, quick: bool, device) -> dict:
    model = build(context, 1, quick, device)
    prompt = random_prompts(model.config.vocab_size, [context], seed=1)[0]
    source, follower = model.layers[1].attn.indexer, model.layers[2].attn.indexer
    k = model.config.index_topk
    with torch.no_grad():
        own = chunked(model, prompt, chunk, device)
        model.reset_caches()
        latest, shared, seen = {}, [], []
        source_select, follower_select = source.select, follower.select

        def record(*args):
            latest["blocks"] = source_select(*args)
            return latest["blocks"]

        def reuse(q, weights, q_scales, plan):
            mine = follower_select(q, weights, q_scales, plan)
            wide = plan.lengths > k  # rows whose selection is a choice
            if bool(wide.any()):
                a, b = mine[wide], latest["blocks"][wide]  # [rows, k] distinct block ids each
                offset = torch.arange(a.shape[0], device=a.device)[:, None] * (int(plan.lengths.max()) + 1)
                shared.append(int(torch.isin(a + offset, b + offset).sum()))
                seen.append(a.numel())
            return latest["blocks"]

        source.select, follower.select = record, reuse
        reused = chunked(model, prompt, chunk, device)
        source.select, follower.select = source_select, follower_select
    errors = [((a - b).abs().max() / a.abs().max()).item() for a, b in zip(own, reused)]
    same = [int(a.argmax()) == int(b.argmax()) for a, b in zip(own, reused)]
    return {"context": context, "chunk": chunk, "index_topk": k,
            "agreement": round(sum(shared) / max(sum(seen), 1), 4),
            "logit_error_max": round(max(errors), 4), "logit_error_median": round(sorted(errors)[len(errors) // 2], 4),
            "same_argmax": round(sum(same) / len(same), 3)}


def gain(context: int, chunk: int, quick: bool, device) -> dict:
    row = {"context": context, "chunk": chunk}
    on_cuda = torch.device(device).type == "cuda"
    for reuse in (1, 2):
        model = build(context, reuse, quick, device)
        prompt = random_prompts(model.config.vocab_size, [context], seed=1)[0]
        with torch.no_grad():
            chunked(model, prompt[: 2 * chunk], chunk, device)  # warm-up: first calls, Triton compiles
            model.reset_caches()
            if on_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            chunked(model, prompt, chunk, device)
            if on_cuda:
                torch.cuda.synchronize()
            row[f"prefill_s_reuse{reuse}"] = round(time.perf_counter() - start, 3)
        del model
        if on_cuda:
            torch.cuda.empty_cache()
    row["saved_share"] = round(1 - row["prefill_s_reuse2"] / row["prefill_s_reuse1"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gain-contexts", type=int, nargs="*", default=[131072, 1048576])
    parser.add_argument("--cost-context", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a tiny model at 1024 tokens, any device")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.gain_contexts, args.cost_context, args.chunk = [1024], 1024, 256
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "cost": cost(args.cost_context, args.chunk, args.quick, device), "gain": []}
    print(json.dumps(result["cost"]), flush=True)
    for context in args.gain_contexts:
        result["gain"].append(gain(context, args.chunk, args.quick, device))
        print(json.dumps(result["gain"][-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
