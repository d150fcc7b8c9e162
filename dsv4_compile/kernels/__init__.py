"""Kernels by provider. Each module registers a :class:`dsv4_compile.dispatch.Provider`.

* :mod:`.reference` — plain PyTorch, every device, the executable spec.
"""

from .. import dispatch
from . import reference

dispatch.register_provider(
    dispatch.Provider(
        name=dispatch.REFERENCE,
        device_type="*",
        load=lambda device: reference.KERNELS,
        priority=-1000,
        warn_on_fallback=False,
    )
)
