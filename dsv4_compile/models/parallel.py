"""Tensor parallelism over ``torch.distributed``: which weights a rank holds, and the all-reduce.

With ``N`` ranks, rank ``r`` of the attention layer holds query heads ``[r*H/N, (r+1)*H/N)``: their
rows of ``wq_b``, their ``attn_sink`` entries and their output groups (``o_groups / N`` groups of
``wo_a``, and those groups' columns of ``wo_b``: row-parallel, so each rank's output is a partial
sum that :meth:`TensorParallel.all_reduce` adds up). The ratio-4 indexer splits its heads the same
way (rows of its ``wq_b`` and ``weights_proj``) and all-reduces its block logits before the top-k.
The small MLP is column-parallel (``gate``, ``up``) then row-parallel (``down``) with one
all-reduce. Everything with one KV head is replicated on every rank: ``x_proj`` (``wq_a``,
``wkv`` and the compressors' ``wkv_gate``), the norms, the compressors, the latent caches, the
compressed caches and the indexer's keys (MQA), and the embedding, final norm and LM head. So a rank runs the ``dsv4`` ops over
its ``H/N`` heads, which the ops pad to what a kernel needs (FlashMLA: 64 or 128).

The all-reduce is a functional collective (``torch.distributed._functional_collectives``): it
traces into the compiled graph (no graph break) as ``_c10d_functional.all_reduce`` +
``wait_tensor``.

Weights: a sharded parameter is drawn at its full shape from the model's seeded generator and
sliced (:func:`~dsv4_compile.models.model.init_random_`), so every ``N`` gives the weights of the
unsharded model.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    """A rank's place in a tensor-parallel group: ``rank`` of ``size``, over ``group``."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (None with size 1)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, size) and size >= 1, got rank {self.rank}, size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a tensor-parallel size of {self.size} needs a process group, got None")

    @classmethod
    def from_group(cls, group=None) -> "TensorParallel":
        """The calling rank's place in ``group`` (default: the world) of an initialised
        ``torch.distributed`` process group."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("TensorParallel.from_group needs torch.distributed.init_process_group first")
        group = group if group is not None else dist.group.WORLD
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group)

    def split(self, name: str, total: int) -> int:
        """``total / size`` (what this rank holds of ``name``); raises if ``size`` does not divide it."""
        if total % self.size:
            raise ValueError(f"{name} ({total}) must be a multiple of the tensor-parallel size ({self.size})")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group's ranks (``x`` itself with one rank)."""
        if self.size == 1:
            return x
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.group)


#: one rank holding everything
SINGLE = TensorParallel()


def shard_(module: nn.Module, **dims: int) -> None:
    """Record that ``module``'s parameters named in ``dims`` are split across the ranks along the
    given dimension (``module`` holds the rank's part; :func:`full_shape`, :func:`take_shard`)."""
    module._tp_shards = {**getattr(module, "_tp_shards", {}), **dims}


def shard_dim(module: nn.Module, name: str) -> int | None:
    """The dimension ``module``'s parameter ``name`` is split along, or None if replicated."""
    return getattr(module, "_tp_shards", {}).get(name)


def full_shape(shape: torch.Size, tp: TensorParallel, dim: int) -> tuple[int, ...]:
    return tuple(n * tp.size if d == dim else n for d, n in enumerate(shape))


def take_shard(full: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    """The rank's contiguous part of ``full`` along ``dim``."""
    return full.chunk(tp.size, dim)[tp.rank]


@contextmanager
def torchrun_group(device) -> Iterator[tuple[torch.device, TensorParallel]]:
    """In a process ``torchrun`` launched: this rank's device (``device``; on CUDA the GPU
    ``LOCAL_RANK``, made current), the default process group (NCCL on CUDA, gloo otherwise) and
    the rank's :class:`TensorParallel`. On exit, on every rank: the compiled functions are freed
    (their CUDA graphs hold the group's collectives, and destroying the group under them can hang),
    then the device and the other ranks are waited for, then the group is destroyed."""
    import torch.distributed as dist

    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield device, TensorParallel.from_group()
    finally:
        torch._dynamo.reset()
        if device.type != "cpu":
            torch.get_device_module(device).synchronize(device)
        dist.barrier()
        dist.destroy_process_group()


def all_reduces_in(graphs) -> int:
    """The all-reduce calls in traced FX graphs (e.g. ``torch._dynamo.explain(...).graphs``)."""
    return sum(
        1 for graph in graphs for node in graph.graph.nodes
        if node.op == "call_function" and "all_reduce" in str(node.target)
    )

