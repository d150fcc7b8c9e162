"""Kernels by provider. Each module registers its own :class:`dsv4_compile.dispatch.Provider`
entries at import (ranked by ``dispatch.RANKING``), importing no device library: a provider loads
lazily, at first use.

* :mod:`.reference` — plain PyTorch, every device, the executable spec (``reference``).
* :mod:`.flashmla` — CUDA decode / prefill / scheduler through FlashMLA (``sgl_kernel``, ``flashmla``).
* :mod:`.flashmla_schedule` — FlashMLA's SM90 decode schedule from one Triton program (``flashmla``).
* :mod:`.xpu` — sgl-kernel-xpu on Intel GPUs (``sgl_kernel_xpu``).
* :mod:`.triton_store` — our Triton cache store on CUDA and XPU (``triton``).
* :mod:`.triton_attention` — portable Triton sparse decode and prefill (``triton``): GPUs FlashMLA
  does not serve, XPU without sgl-kernel-xpu.
* :mod:`.triton_indexer` — the lightning indexer's block logits in Triton (``triton``, CUDA and XPU).
* :mod:`.triton_rope` — the RoPE of a tensor's last 64 dims, in place, in Triton (``triton``, CUDA and XPU).
* :mod:`.triton_common` — what the Triton modules share: lazy jit, availability, inlining rules.
"""

from . import flashmla, reference, triton_attention, triton_indexer, triton_rope, triton_store, xpu  # noqa: F401 (registration)
