"""Drop-in Python interfaces of the libraries DSV4 serving stacks call, over the ``dsv4`` ops.

Serving code written against FlashMLA's Python interface or sgl-kernel-xpu's switches with one
import, on every device (CUDA, XPU, CPU), and then traces under ``torch.compile``:

* :mod:`.flash_mla` — FlashMLA's interface (``import flash_mla``; ``sgl_kernel.flash_mla``):
  ``get_mla_metadata``, ``flash_mla_with_kvcache``, ``flash_mla_sparse_fwd``,
  ``FlashMLASchedMeta``;
* :mod:`.sgl_kernel` — sgl-kernel-xpu's (``import sgl_kernel`` on Intel GPUs):
  ``flash_mla_with_kvcache``, ``flash_mla_sparse_fwd``, ``fused_k_norm_rope_flashmla``.

::

    from dsv4_compile.compat import flash_mla   # instead of: if _is_xpu: ... else: import flash_mla

What each accepts, rejects or ignores of the upstream arguments is in the modules' docstrings and
the README's migration guide.
"""

from . import flash_mla, sgl_kernel

__all__ = ["flash_mla", "sgl_kernel"]
