"""The batch-invariant mode (docs/design.md §3): a row's outputs do not depend on the batch.

In the mode, every attention op gives a query row the same bits whatever else is in its call:
the batch size, the row's position, the other rows' lengths and ``topk_length``, the scheduler
metadata, and ``s_q = 1`` decode against the same query inside an MTP-style ``s_q > 1`` step
(for the same index widths). The ops whose kernels would otherwise depend on the batch take an
argument, ``batch_invariant`` (decode, prefill, the indexer's logits); the others (the stores,
``rope_``, ``indexer_topk``, the scheduler metadata) are row-wise on every provider.

The switch is process-wide: :func:`batch_invariant` (a context manager), :func:`set_batch_invariant`,
or ``DSV4_COMPILE_BATCH_INVARIANT=1`` (read at import and by ``dispatch.reset()``). It is read by
the Python entry points — the public wrappers (``dsv4_compile.flash_mla_with_kvcache``, ...), the
drop-in interfaces and the model — which pass it to the ops as ``batch_invariant=True``; a direct
``torch.ops.dsv4.*`` call passes the argument itself. Read in Python, the switch is a guard of
every function ``torch.compile`` traced through those entry points: flipping it recompiles them.

The Triton decode's split size in the mode (``DSV4_COMPILE_INVARIANT_SPLIT_KEYS``, read at import:
``providers.triton.attention.INVARIANT_SPLIT_KEYS``) is fixed for the process; a row's bits depend
on it as they do on the index widths.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from .checks import env_flag

ENV = "DSV4_COMPILE_BATCH_INVARIANT"

# module globals, so that torch.compile guards on them
_set: bool | None = None  # set_batch_invariant's value; None: the environment's
_env = False  # DSV4_COMPILE_BATCH_INVARIANT, as last read


def enabled() -> bool:
    """Whether the batch-invariant mode is on (process-wide): :func:`set_batch_invariant`'s value,
    else ``DSV4_COMPILE_BATCH_INVARIANT`` as read at import or ``dispatch.reset()``."""
    return _env if _set is None else _set


def set_batch_invariant(on: bool | None = True) -> None:
    """Turn the batch-invariant mode on (or off) for the whole process; ``None``: as the
    environment says."""
    global _set
    _set = None if on is None else bool(on)


@contextlib.contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Within the block, the batch-invariant mode is ``on`` (process-wide, restored on exit)::

        with dsv4_compile.batch_invariant():
            out, lse = dsv4_compile.flash_mla_with_kvcache(q, cache, 256, indices, ...)
    """
    before = _set
    set_batch_invariant(on)
    try:
        yield
    finally:
        set_batch_invariant(before)


def resolve(argument: bool | None) -> bool:
    """A wrapper's ``batch_invariant`` argument: ``None`` takes the switch."""
    return enabled() if argument is None else bool(argument)


def read_environment() -> None:
    """Read ``DSV4_COMPILE_BATCH_INVARIANT`` (at import, and by ``dispatch.reset()``)."""
    global _env
    _env = env_flag(ENV)


read_environment()
