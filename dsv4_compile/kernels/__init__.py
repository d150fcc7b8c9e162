"""Kernels by provider. Each module registers a :class:`dsv4_compile.dispatch.Provider`.

* :mod:`.reference` — plain PyTorch, every device, the executable spec.
* :mod:`.flashmla` — CUDA decode / prefill / scheduler through FlashMLA (sgl_kernel or flash_mla).
* :mod:`.xpu` — sgl-kernel-xpu (``sgl_kernel``) on Intel GPUs.

Registering a provider imports no device library: each provider loads lazily, at first use.
"""

from .. import dispatch
from . import flashmla, reference, xpu

flashmla.register()
xpu.register()

dispatch.register_provider(
    dispatch.Provider(
        name=dispatch.REFERENCE,
        device_type="*",
        load=lambda device: reference.KERNELS,
        priority=-1000,
        fallback=True,
    )
)
