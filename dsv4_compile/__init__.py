"""dsv4_compile: DeepSeek V4 attention kernels as ``torch.ops.dsv4.*`` custom ops.

Importing this package registers the ops (schemas, fakes, one kernel per dispatch key) so that
DSV4 attention traces into one ``torch.compile`` graph and the dispatcher picks the device kernel.
"""

from . import providers as _providers  # noqa: F401  (registers the providers)
from . import compat, layout, ops
from .checks import checked, checked_mode
from .dispatch import ProviderUnavailable, provider_chain, providers, use_provider
from .invariance import batch_invariant, set_batch_invariant
from .layout import FORMATS, alloc_cache, dequant_workspace, flashmla_view, gather_dequant, page_bytes
from .ops import *  # noqa: F403 (the ops' wrappers: ops.__all__)

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "ProviderUnavailable",
    "alloc_cache",
    "batch_invariant",
    "checked",
    "compat",
    "checked_mode",
    "dequant_workspace",
    "flashmla_view",
    "gather_dequant",
    "layout",
    "ops",
    "page_bytes",
    "provider_chain",
    "providers",
    "set_batch_invariant",
    "use_provider",
    *ops.__all__,
]
