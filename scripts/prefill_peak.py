"""The eager prefill's peak of live activation bytes, and what holds it, on any device.

CPU has no allocator statistics, so this counts tensors instead: a dispatch mode adds each new
storage an op returns (parameters and buffers excluded) and drops it when its last tensor dies;
at the peak it records the model's source lines on the stack and the largest live storages with
the op, shape and lines that made them. Tensors an op allocates and frees inside itself (a
kernel's workspace) are not seen. On CUDA, ``bench_step.py`` measures the allocator's peak.

    python scripts/prefill_peak.py [--tokens 1024] [--device cpu]

The model is ``bench_step.py``'s DSV4-Flash-sized slice (4 layers, hidden 4096, 64 heads), one
prefill step of ``--tokens`` tokens in 4 prompts.
"""

from __future__ import annotations

import argparse
import sys
import traceback
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dsv4_compile.generation import prefill_prompts, random_prompts
from dsv4_compile.models import CacheConfig, DeepseekV4Model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_step import slice_config  # noqa: E402  (the step benchmark's model)


def model_frames(skip: int = 1) -> list[traceback.FrameSummary]:
    return [f for f in traceback.extract_stack()[:-skip] if "/dsv4_compile/" in f.filename]


def describe(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename.split('/')[-1]}:{frame.lineno} {frame.name}: {frame.line}"


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages ops return (``existing``: storage pointers not to count;
    ``exclude``: a peak reached under a model source line holding this text is not recorded)."""

    def __init__(self, existing: set[int], exclude: str | None = None):
        super().__init__()
        self.existing, self.exclude = existing, exclude
        self.live = self.peak = 0
        self.storages: dict[int, list] = {}  # pointer -> [bytes, live tensors, what made it]
        self.at_peak: tuple = ((), [])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.existing:
                continue
            entry = self.storages.get(key)
            if entry is None:
                frames = model_frames(2)
                made = f"{func} {tuple(t.shape)} {t.dtype} at {describe(frames[-1]) if frames else '?'}"
                self.storages[key] = entry = [size, 0, made]
                self.live += size
            entry[1] += 1
            weakref.finalize(t, self._release, key)
        if self.live > self.peak:
            frames = model_frames()
            if self.exclude is None or not any(self.exclude in (f.line or "") for f in frames):
                self.peak = self.live
                largest = sorted(self.storages.values(), key=lambda e: -e[0])[:6]
                self.at_peak = ([describe(f) for f in frames[-4:]], [(e[0], e[2]) for e in largest])
        return out

    def _release(self, key: int) -> None:
        entry = self.storages.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.live -= entry[0]
                del self.storages[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    config = slice_config()
    model = DeepseekV4Model(config, CacheConfig(max_requests=4, max_seq_len=4096, page_size=256),
                            seed=0, device=args.device)
    existing = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    prompts = random_prompts(config.vocab_size, [args.tokens // 4] * 4)
    # the LM head of the last tokens is left out: on CPU its bf16 GEMM copies the weight
    with torch.no_grad(), LiveBytes(existing, exclude="lm_head") as live:
        prefill_prompts(model, prompts, args.device)
    lines, largest = live.at_peak
    print(f"{args.tokens} tokens: peak {live.peak / 2**20:.1f} MB of live tensors, "
          f"{live.peak / args.tokens / 1e6:.3f} MB per token; at")
    print("  " + "\n  ".join(lines))
    print("largest live storages:")
    for size, made in largest:
        print(f"  {size / 2**20:7.1f} MB  {made}")


if __name__ == "__main__":
    main()
