"""Throwaway: time the geometries other GPUs get, on the H200 (prefill and decode)."""
import json, sys, torch
import bench_triton_attention as b
from dsv4_compile.kernels import triton_attention as ta
torch.manual_seed(0)
dev = torch.device("cuda", 0)
copy = b.copy_rate(dev) / 1e12
out = {}
b.PREFILL_SWEEP = [ta.PREFILL_CONFIG, ta.PREFILL_CONFIG_SM100, ta.PREFILL_CONFIG_SMALL, ta.PREFILL_CONFIG_LOW_SHARED]
p = b.bench_prefill(64, 640, False, True, copy, 989.4)
out["prefill"] = p["sweep"]
for r in p["sweep"]:
    print("prefill", r, flush=True)
b.DECODE_SWEEP = [ta.DECODE_CONFIG, ta.DECODE_CONFIG_SMALL]
b.MIN_SPLIT_KEYS_SWEEP = ()
out["decode"] = {}
for rows in (1, 8, 64, 256):
    d = b.bench_decode(rows, 64, False, True, copy, 989.4)
    out["decode"][rows] = d["sweep"]
    for r in d["sweep"]:
        print("decode", rows, r, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
