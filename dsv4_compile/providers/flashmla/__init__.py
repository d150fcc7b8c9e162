"""The ``sgl_kernel`` and ``flashmla`` providers: CUDA decode / prefill / scheduler over FlashMLA's
kernels, from sgl-kernel (``sgl_kernel.flash_mla``) and from sgl-flash-mla (``flash_mla``).

* :mod:`.adapter` — the adapter both names share, and their two registrations.
* :mod:`.schedule` — FlashMLA's SM90 decode schedule from one Triton program (``flashmla``).
"""

from . import adapter  # noqa: F401 (registration)
