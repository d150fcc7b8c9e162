"""Reproducer for an upstream Triton report: the sparse decode kernel with 16-key blocks on SM90.

``providers.triton.attention.Config`` refuses key blocks below 32 because, compiled by Triton 3.6
for an H200 (SM90), the decode kernel with 16-key blocks gave outputs far from the reference, while
the same kernel with 32 and 64 keys per block matches it (and the interpreter matches it at 16).
This script builds those geometries anyway (bypassing the refusal), runs the kernel and the
plain-PyTorch reference on the same CUDA tensors for 16-, 32- and 64-key geometries, with one split
per row and with three (the combine kernel), and prints the largest difference of each, with the
Triton version and the GPU. Exit status 1 if a 16-key geometry differs beyond the device
tolerance while the others do not (the bug reproduced), 0 otherwise.

    python scripts/repro_triton_16key_decode.py
"""

from __future__ import annotations

import dataclasses
import sys

import torch

import dsv4_compile as d4
from dsv4_compile import layout
from dsv4_compile.providers import reference
from dsv4_compile.providers.triton import attention as ta, common as triton_common
from dsv4_compile.tolerances import DEVICE


def geometry(block_h: int, block_n: int, num_warps: int, num_stages: int) -> ta.Config:
    """A decode geometry, without ``Config``'s refusal of 16 keys per block."""
    config = object.__new__(ta.Config)
    values = dict(block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    for field in dataclasses.fields(ta.Config):
        object.__setattr__(config, field.name, values.get(field.name, field.default))
    return config


#: (block_h, block_n, num_warps, num_stages): the 16-key geometries that failed (a test's 16 x 16
#: and two of the sweep's), and 32- and 64-key ones for contrast
GEOMETRIES = [(16, 16, 4, 1), (64, 16, 8, 2), (64, 16, 8, 3), (16, 32, 4, 1), (64, 64, 8, 2)]


def force_splits(n: int) -> None:
    """Make the decode cut each row's keys into ``n`` splits (combined by the second kernel)."""
    triton_common.compute_units = lambda device: n * 1_000_000
    ta.MAX_SPLITS, ta.MIN_SPLIT_KEYS = n, 1


def case(device: str, heads: int = 64, batch: int = 4, width: int = 128, page_size: int = 64):
    """Decode arguments over a filled V4 cache: random slots, a few holes, full lengths."""
    pages = 8
    cache = d4.alloc_cache(pages, page_size, device=device)
    slots = torch.arange(pages * page_size, device=device)
    kv = (3 * torch.randn(len(slots), layout.HEAD_DIM, device=device)).bfloat16()
    weight = torch.ones(layout.HEAD_DIM, dtype=torch.bfloat16, device=device)
    angles = torch.arange(len(slots), device=device)[:, None] * torch.rand(layout.ROPE_DIM // 2, device=device)
    freqs = torch.stack([angles.cos(), angles.sin()], -1).flatten(-2).float()
    d4.fused_k_norm_rope_flashmla(kv, weight, freqs, slots, slots, cache, 1e-6, page_size)
    indices = torch.randint(0, len(slots), (batch, 1, width), dtype=torch.int32, device=device)
    indices[torch.rand(indices.shape, device=device) < 0.1] = -1
    q = torch.randn(batch, 1, heads, layout.HEAD_DIM, device=device).bfloat16()
    scale = layout.HEAD_DIM**-0.5
    return (q, cache, page_size, indices, None, None, None, 1, None, None, None, None, scale, layout.HEAD_DIM,
            "v4", None)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    import triton

    torch.manual_seed(0)
    args = case("cuda")
    want_out, want_lse = reference.flash_mla_with_kvcache(*args)
    vmax = layout.gather_dequant(args[1], args[2], torch.arange(layout.capacity(args[1], args[2]), device="cuda"),
                                 torch.float32).abs().max().item()
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()} "
          f"(SM{''.join(map(str, torch.cuda.get_device_capability()))})")
    bad = {}
    for splits in (1, 3):
        force_splits(splits)
        for geo in GEOMETRIES:
            ta.decode_config = lambda device, c=geometry(*geo): c
            out, lse = ta.flash_mla_with_kvcache(*args)
            err_out = (out.float() - want_out.float()).abs().max().item()
            err_lse = (lse - want_lse).abs().max().item()
            tol = DEVICE["out"].atol * vmax + DEVICE["out"].rtol * want_out.abs().max().item()
            bad[geo, splits] = not err_out <= tol  # NaN counts as a difference
            print(f"heads x keys {geo[0]:>2} x {geo[1]:>2}, {geo[2]} warps, {geo[3]} stages, {splits} split(s): "
                  f"max |out - reference| {err_out:.3e} (tolerance {tol:.3e}), max |lse - reference| {err_lse:.3e}"
                  f"{'  <- differs' if bad[geo, splits] else ''}")
    sixteen = any(v for (geo, _), v in bad.items() if geo[1] == 16)
    return 1 if sixteen and not any(v for (geo, _), v in bad.items() if geo[1] > 16) else 0

if __name__ == "__main__":
    sys.exit(main())
