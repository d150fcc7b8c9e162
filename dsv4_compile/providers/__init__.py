"""The providers, one module or folder per provider name in ``dispatch.RANKING``. Each registers its
own :class:`dsv4_compile.dispatch.Provider` entries at import (ranked by ``dispatch.RANKING``),
importing no device library: a provider loads lazily, at first use.

* :mod:`.reference` — ``reference``: plain PyTorch, every device, the executable spec.
* :mod:`.flashmla` — ``sgl_kernel`` and ``flashmla``: CUDA decode / prefill / scheduler through
  FlashMLA (:mod:`.flashmla.adapter`, both names), with FlashMLA's SM90 decode schedule from one
  Triton program (:mod:`.flashmla.schedule`, ``flashmla``).
* :mod:`.sgl_kernel_xpu` — ``sgl_kernel_xpu``: sgl-kernel-xpu on Intel GPUs.
* :mod:`.triton` — ``triton``: our Triton kernels on CUDA and XPU (:mod:`.triton.store`,
  :mod:`.triton.attention`, :mod:`.triton.indexer`, :mod:`.triton.rope`; what they share:
  :mod:`.triton.common`).
"""

from . import flashmla, reference, sgl_kernel_xpu, triton  # noqa: F401 (registration)
