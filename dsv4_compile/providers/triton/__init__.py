"""The ``triton`` provider: our Triton kernels on CUDA and XPU. Each module registers its ops'
entries at import; none imports Triton until first use (:mod:`.common`).

* :mod:`.attention` — portable sparse decode and prefill: GPUs FlashMLA does not serve, XPU
  without sgl-kernel-xpu.
* :mod:`.indexer` — the lightning indexer's block logits and top-k.
* :mod:`.rope` — the RoPE of a tensor's last 64 dims, in place.
* :mod:`.store` — the cache store.
* :mod:`.common` — what the modules share: lazy jit, availability, inlining rules.
"""

from . import attention, indexer, rope, store  # noqa: F401 (registration)
