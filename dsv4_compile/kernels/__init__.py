"""Kernels by provider. Each module registers a :class:`dsv4_compile.dispatch.Provider`.

* :mod:`.reference` — plain PyTorch, every device, the executable spec.
* :mod:`.flashmla` — CUDA decode / prefill / scheduler through FlashMLA (sgl_kernel or flash_mla).
* :mod:`.xpu` — sgl-kernel-xpu (``sgl_kernel``) on Intel GPUs.
* :mod:`.triton_store` — our Triton cache store (``fused_k_norm_rope_flashmla``) on CUDA and XPU.
* :mod:`.triton_attention` — portable Triton sparse decode and prefill (the ``triton`` provider
  with the store): GPUs FlashMLA does not serve, XPU without sgl-kernel-xpu.
* :mod:`.triton_common` — what the Triton modules share: lazy jit, availability, inlining rules.

Registering a provider imports no device library: each provider loads lazily, at first use.
"""

from .. import dispatch
from . import flashmla, reference, triton_attention, triton_store, xpu  # noqa: F401 (compile rules)

flashmla.register()
xpu.register()
triton_store.register()

dispatch.register_provider(
    dispatch.Provider(
        name=dispatch.REFERENCE,
        device_type="*",
        load=lambda device: reference.KERNELS,
        priority=-1000,
        fallback=True,
    )
)
