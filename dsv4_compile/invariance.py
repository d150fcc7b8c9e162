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

The mode's split size (``DSV4_COMPILE_INVARIANT_SPLIT_KEYS``, default :data:`DEFAULT_SPLIT_KEYS`):
the Triton decode cuts each row's keys into splits of this many entries whatever the batch, so a
row's bits depend on it as they do on the widths. Small splits keep a small batch's programs
short, large ones write fewer partial results at a large batch (``benchmarks/RESULTS.md``,
"Batch-invariant mode", has the time at each size). Like a server's attention tile size, it is
fixed for the process: read once, at import (a later change would leave compiled programs with the
old size).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from .checks import env_flag

ENV = "DSV4_COMPILE_BATCH_INVARIANT"
SPLIT_KEYS_ENV = "DSV4_COMPILE_INVARIANT_SPLIT_KEYS"
#: Keys per split of a row in the mode's Triton decode, unless the environment says otherwise.
DEFAULT_SPLIT_KEYS = 256
#: Split sizes are whole key blocks of every decode geometry (the largest has 64 keys).
SPLIT_KEYS_MULTIPLE = 64

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


def split_keys_from_environment() -> int:
    """The mode's split size: ``DSV4_COMPILE_INVARIANT_SPLIT_KEYS`` (a positive multiple of
    :data:`SPLIT_KEYS_MULTIPLE`), :data:`DEFAULT_SPLIT_KEYS` if unset or empty."""
    text = os.environ.get(SPLIT_KEYS_ENV, "").strip()
    if not text:
        return DEFAULT_SPLIT_KEYS
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value <= 0 or value % SPLIT_KEYS_MULTIPLE:
        raise ValueError(f"{SPLIT_KEYS_ENV} must be a positive multiple of {SPLIT_KEYS_MULTIPLE} "
                         f"(keys per split of a row in the batch-invariant mode), got {text!r}")
    return value


#: The mode's split size for this process (:func:`split_keys_from_environment`, at import).
SPLIT_KEYS = split_keys_from_environment()
