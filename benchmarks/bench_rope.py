"""The attention output's inverse RoPE, compiled alone: how Inductor's kernel for each way of
writing it compares with a copy of the same tensor.

The attention block rotates the last ``ROPE_DIM`` dims of every head of the attention output
``[T, H, 512]`` (bf16) back before the output projection. Forms timed (each ``torch.compile``-d
alone, µs per call in a CUDA graph of 20 calls: ``common.graph_timed``):

* ``copy``: ``out.clone()``, the floor for a pass over the tensor;
* ``full_width``: the model's form, :func:`~dsv4_compile.models.rope.rope_last` over the whole
  head width, then bf16;
* ``tail_in_place``: ``out[..., -64:].copy_(apply_rope(out[..., -64:]))``, a write of the
  rotated dims only (``out`` is the compiled function's input here, so Inductor mutates it);
* ``slice_scatter``: the functional form of the same write;
* ``op``: ``dsv4::rope_`` in place (the model's form now; its Triton kernel on CUDA).

Each form's result is compared with the eager ``full_width`` (``equal``: bit for bit).

    python benchmarks/bench_rope.py [--tokens 8 64]
"""

from __future__ import annotations

import argparse

import torch

from bench_step import slice_config
from common import graph_timed
import dsv4_compile as d4
from dsv4_compile import layout
from dsv4_compile.models.rope import apply_rope, layer_rope_table, rope_last

R = layout.ROPE_DIM


def forms(table: torch.Tensor) -> dict:
    def full_width(out, pos):
        return rope_last(out, table, pos, inverse=True).to(out.dtype)

    def tail_in_place(out, pos):
        tail = out[..., -R:]
        tail.copy_(apply_rope(tail, table, pos, inverse=True))
        return out

    def slice_scatter(out, pos):
        rotated = apply_rope(out[..., -R:], table, pos, inverse=True).to(out.dtype)
        return torch.slice_scatter(out, rotated, dim=-1, start=out.shape[-1] - R)

    def op(out, pos):
        d4.rope_(out, table, pos, inverse=True)
        return out

    return {"copy": lambda out, pos: out.clone(), "full_width": full_width,
            "tail_in_place": tail_in_place, "slice_scatter": slice_scatter, "op": op}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--heads", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cuda")
    table = layer_rope_table(slice_config(), 4, device)
    for tokens in args.tokens:
        pos = torch.randint(0, table.shape[0], (tokens,), device=device)
        x = torch.randn(tokens, args.heads, layout.HEAD_DIM, device=device).to(torch.bfloat16)
        with torch.no_grad():
            want = forms(table)["full_width"](x.clone(), pos)
            for name, form in forms(table).items():
                torch._dynamo.reset()
                compiled = torch.compile(form, fullgraph=True)
                equal = torch.equal(compiled(x.clone(), pos), x if name == "copy" else want)
                y = x.clone()
                us = graph_timed(lambda: compiled(y, pos), per_graph=20)
                print(f"T={tokens} H={args.heads} {name:14s} {us:6.2f} us  equal to eager: {equal}", flush=True)


if __name__ == "__main__":
    main()
