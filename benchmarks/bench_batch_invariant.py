"""The cost of the batch-invariant mode on CUDA: the Triton decode and prefill in the mode against
the default, in one run.

    PYTHONPATH=. python benchmarks/bench_batch_invariant.py [--json out.json] [--rows T ...] [--split-keys N ...]

Decode: the DSV4 step of ``common.decode_inputs`` (H = 64, window 128 keys + c4 512 keys, random
lengths), T in ``--rows`` (default {1, 8, 64, 256}); CUDA-graph replays (``common.graph_timed``, medians). ``ratio`` =
mode time / default time (target: <= 1.3 at every T). Also, per T, the mode with each split size of
``--split-keys`` (default :data:`SPLIT_KEYS_SWEEP`; ``attention.INVARIANT_SPLIT_KEYS``, ``*`` the default) and FlashMLA's
default (the provider the default mode gets on SM90) for context. Prefill: s_q = 4096, s_kv = 8192,
H = 64, top-k 640 (one kernel in both modes: the ratio shows the noise). Each decode row is also
checked: its bits alone equal its bits in the batch, in the mode.
"""

from __future__ import annotations

import argparse
import json

import torch

import dsv4_compile as d4
from dsv4_compile import dispatch, layout
from dsv4_compile.providers.triton import attention as ta
from common import DECODE_ROWS, DEV, decode_inputs, graph_timed

SCALE = layout.HEAD_DIM**-0.5
SPLIT_KEYS_SWEEP = (128, 256, 384, 512, 640)


def decode(args, batch_invariant, provider="triton"):
    q, cache, idx, lengths, sink, ecache, eidx, elen = args
    with d4.use_provider(provider, ops=("flash_mla_with_kvcache",)):
        return d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen,
                                         softmax_scale=SCALE, batch_invariant=batch_invariant)


def rows_alone_equal(args) -> int:
    """Rows whose mode outputs alone equal their outputs in the batch, bit for bit."""
    out, lse = decode(args, True)
    equal = 0
    for r in range(args[0].shape[0]):
        one = [a[r : r + 1] if i in (0, 2, 3, 6, 7) else a for i, a in enumerate(args)]  # the per-row tensors
        o, l = decode(one, True)
        equal += bool(torch.equal(o[0], out[r]) and torch.equal(l[0], lse[r]))
    return equal


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--rows", type=int, nargs="+", default=list(DECODE_ROWS))
    parser.add_argument("--split-keys", type=int, nargs="+", default=list(SPLIT_KEYS_SWEEP))
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "decode": {}, "prefill": {}}
    has_flashmla = "flashmla" in dispatch.registered_providers("cuda") and \
        d4.providers("cuda")["flash_mla_with_kvcache"] == "flashmla"
    for rows in args.rows:
        inputs = decode_inputs(rows)
        default = graph_timed(lambda: decode(inputs, False))
        invariant = graph_timed(lambda: decode(inputs, True))
        sweep = {}
        for keys in args.split_keys:
            before, ta.INVARIANT_SPLIT_KEYS = ta.INVARIANT_SPLIT_KEYS, keys
            try:
                sweep[keys] = graph_timed(lambda: decode(inputs, True))
            finally:
                ta.INVARIANT_SPLIT_KEYS = before
        entry = {"triton_default_us": default, "triton_invariant_us": invariant, "ratio": invariant / default,
                 "split_keys_us": sweep, "rows_alone_equal": rows_alone_equal(inputs), "rows": rows}
        if has_flashmla:
            entry["flashmla_default_us"] = graph_timed(lambda: decode(inputs, False, "flashmla"))
        report["decode"][rows] = entry
        print(f"decode T={rows:>3}: default {default:7.1f} us  mode {invariant:7.1f} us  ratio {invariant / default:.2f}  "
              + "  ".join(f"{k}{'*' if k == ta.INVARIANT_SPLIT_KEYS else ''}:{v:.1f}" for k, v in sweep.items())
              + f"  rows equal {entry['rows_alone_equal']}/{rows}", flush=True)
    s_q, s_kv, topk, heads = 4096, 8192, 640, 64
    q = torch.randn(s_q, heads, 512, dtype=torch.bfloat16, device=DEV)
    kv = torch.randn(s_kv, 1, 512, dtype=torch.bfloat16, device=DEV)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), dtype=torch.int32, device=DEV)
    with d4.use_provider("triton", ops=("flash_mla_sparse_fwd",)):
        times = {mode: graph_timed(lambda: d4.flash_mla_sparse_fwd(q, kv, idx, SCALE, batch_invariant=mode), per_graph=2)
                 for mode in (False, True)}
    report["prefill"] = {"triton_default_us": times[False], "triton_invariant_us": times[True],
                         "ratio": times[True] / times[False]}
    print(f"prefill s_q={s_q}: default {times[False]:.1f} us  mode {times[True]:.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
