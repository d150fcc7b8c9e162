"""The ``dsv4`` operator contract (docs/design.md §2), one module per op family.

A family's module holds, for each of its ops, everything that defines it: the metadata and data
checks, the output geometry and the fake, what provider rules may read of a call, the schema in
one ``registry.define(OpSpec(...))``, and the public wrapper.

* :mod:`.store` — ``fused_k_norm_rope_flashmla``, ``quantize_store`` (§2.1)
* :mod:`.decode` — ``flash_mla_with_kvcache``, ``get_mla_metadata``, ``get_mla_metadata_stacked`` (§2.3)
* :mod:`.prefill` — ``flash_mla_sparse_fwd`` (§2.4)
* :mod:`.indexer` — ``indexer_logits``, ``indexer_topk``, ``indexer_store``, ``indexer_cache_logits``, ``indexer_cache_topk`` (§2.8, §2.9, §2.11, §2.12)
* :mod:`.rope` — ``rope_`` (§2.10)
* :mod:`.registry` — :func:`~.registry.define`: the ``torch.library`` registration, the eager
  fast path and the op list, from one ``OpSpec``

Importing the package defines every op; the wrappers (each family's ``__all__``) are re-exported
here and at the top level.
"""

from .. import dispatch
from . import store, decode, prefill, indexer, rope  # noqa: I001 (the order defines dispatch.OPS)
from .store import *  # noqa: F403 (each family's __all__: its wrappers)
from .decode import *  # noqa: F403
from .prefill import *  # noqa: F403
from .indexer import *  # noqa: F403
from .rope import *  # noqa: F403
from .registry import SCHEMAS  # noqa: F401

dispatch.reset()  # read the environment now: DSV4_COMPILE_PROVIDER may name any op defined above

__all__ = [*store.__all__, *decode.__all__, *prefill.__all__, *indexer.__all__, *rope.__all__]
