"""Argument validation for the ``dsv4`` ops: the machinery the fakes and every kernel share.

Each op's own checks sit with the op, in its family's module under ``ops/`` (``check_<op>``,
``check_<op>_data``), written with :class:`Checker`; this module holds what they share (the
checker, the dtypes they accept, :data:`MAX_INDEX_WIDTH`) and *checked mode*. It stays below the
``ops`` package because :mod:`dsv4_compile.dispatch`, which the ops import, reads checked mode.

Two levels:

* **Metadata checks** (dtype, rank, shape, device, page geometry) run on every call, in the fake and
  in the real kernels alike, and never touch tensor data: they are free under ``torch.compile`` and
  CUDA-graph capture.
* **Data checks** (slots and indices in range, positions inside ``freqs``, lengths <= widths) read
  tensor values, which on a GPU means a device sync. They run in *checked mode* only — enabled by
  :func:`checked` or ``DSV4_COMPILE_CHECKED=1`` — and always before a provider that indexes with
  those values unchecked (the reference: ``Provider.checks_data``).

``check_<op>(*args)`` are the metadata checks (the fakes and the op kernels run them on every call;
they return the sizes the fake and the kernels need); ``check_<op>_data(*args)`` the data checks,
on arguments that passed the metadata checks.

Every failure names the op, the argument, what was expected and what was got. All checks of a call
run before anything is written, so a rejected call leaves every cache byte unchanged.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Sequence

import torch

from . import layout

CHECKED_ENV = "DSV4_COMPILE_CHECKED"
#: Widest index row accepted (``indices``/``extra_indices`` last dim): 2^20 keys per query row, 128x
#: the widest DSV4 row at a 1M-token context (c128 layers attend every compressed token: 8192),
#: far below where int32 slot arithmetic or a kernel's workspace would break. Wider is rejected
#: before anything is allocated (e.g. a stride-0 ``expand`` to 2^31 columns).
MAX_INDEX_WIDTH = 1 << 20
#: The dtypes the ops' checks accept (:meth:`Checker.tensor`'s ``dtypes``).
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # stored keys, rotated tensors
INDEX_DTYPES = (torch.int32, torch.int64)  # slots, positions
BF16 = (torch.bfloat16,)
F32 = (torch.float32,)
I32 = (torch.int32,)


class _ThreadState(threading.local):
    checked = None  # the innermost checked()'s flag on this thread (a class default: a fast read)


_state = _ThreadState()
_env_checked = False  # DSV4_COMPILE_CHECKED, as last read


def env_flag(name: str) -> bool:
    """A boolean environment variable: unset, empty, ``0``, ``false``, ``no``, ``off`` are false."""
    return os.environ.get(name, "0").lower() not in ("", "0", "false", "no", "off")


def read_environment() -> None:
    """Read ``DSV4_COMPILE_CHECKED`` (at import, and by ``dispatch.reset()``)."""
    global _env_checked
    _env_checked = env_flag(CHECKED_ENV)


def checked_mode() -> bool:
    """Whether data checks run on device kernels (see module docstring): the innermost
    :func:`checked` block, else ``DSV4_COMPILE_CHECKED`` as read at import or ``dispatch.reset()``."""
    flag = _state.checked
    return _env_checked if flag is None else flag


@contextlib.contextmanager
def checked(enabled: bool = True) -> Iterator[None]:
    """Enable (or disable) data checks for the calls made inside the block, on every device.

    Checks happen when the op *runs*, so this works around eager calls and around calls of an
    already compiled function alike (except Triton launches traced into a graph: see the README).
    Checked mode syncs the device: do not capture CUDA graphs in it.
    """
    previous = _state.checked
    _state.checked = enabled
    try:
        yield
    finally:
        _state.checked = previous


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
    if isinstance(t, str):
        return t
    if isinstance(t, tuple):
        return "(" + ", ".join(_describe(x) for x in t) + ")"
    return repr(t)


class Checker:
    """Validation helpers bound to one op name, so every message starts with it. The checks run
    on every call: each passes with a few comparisons and builds its message only on failure."""

    __slots__ = ("op",)

    def __init__(self, op: str):
        self.op = op

    def fail(self, arg: str, expected: str, got, exc: type[Exception] = ValueError):
        raise exc(f"dsv4.{self.op}: {arg} must be {expected}, got {_describe(got)}")

    def same_device(self, names: tuple[str, ...], *values) -> torch.device:
        """The device the tensors among ``values`` (``None`` skipped) share. Otherwise the odd one
        out is named (``names`` are the values' argument names): the first argument not on the
        device most of them are on (ties: the device of the earliest)."""
        device = None
        for t in values:
            if t is not None:
                if device is None:
                    device = t.device
                elif t.device != device:
                    self._device_failure(names, values)
        return device

    def _device_failure(self, names, values):
        placed = [(arg, t.device) for arg, t in zip(names, values) if isinstance(t, torch.Tensor)]
        devices = [d for _, d in placed]
        majority = max(dict.fromkeys(devices), key=devices.count)  # first-seen wins ties
        odd, got = next((arg, d) for arg, d in placed if d != majority)
        like = ", ".join(arg for arg, d in placed if d == majority)
        raise ValueError(f"dsv4.{self.op}: {odd} must be on {majority} like {like}, got {got}")

    def tensor(self, arg: str, t, dtypes: Sequence[torch.dtype], shape: Sequence[int | None]) -> torch.Size:
        """Check type, dtype, rank and sizes (``None`` = any) of one tensor argument; its sizes."""
        if isinstance(t, torch.Tensor) and t.dtype in dtypes:
            size = t.shape
            if len(size) == len(shape):
                i = 0
                for want in shape:
                    if want is not None and want != size[i]:
                        break
                    i += 1
                else:
                    return size
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        dims = ", ".join("*" if n is None else str(n) for n in shape)
        expected = f"{names} [{dims}]"
        if not isinstance(t, torch.Tensor):
            self.fail(arg, f"a tensor {expected}", t, TypeError)
        self.fail(arg, expected, t, TypeError if t.dtype not in dtypes else ValueError)

    def flag(self, arg: str, value) -> bool:
        """A ``bool`` argument (e.g. ``batch_invariant``)."""
        if type(value) is not bool:
            self.fail(arg, "a bool", value, TypeError)
        return value

    def positive_int(self, arg: str, value) -> int:
        if type(value) is not int or value < 1:  # bool is no int here
            self.fail(arg, "a positive int", value)
        return value

    def width(self, arg: str, t: torch.Tensor, size: torch.Size) -> int:
        """The index width of ``t`` (the last of its checked sizes ``size``), at most
        :data:`MAX_INDEX_WIDTH`."""
        width = size[-1]
        if width > MAX_INDEX_WIDTH:
            self.fail(arg, f"at most {MAX_INDEX_WIDTH} index columns wide", t)
        return width

    def kv_format(self, arg: str, fmt) -> layout.CacheFormat:
        """One of ``layout.FORMATS`` (the ops' trampolines have resolved a known name to it)."""
        if type(fmt) is not layout.CacheFormat:
            self.fail(arg, f"one of {list(layout.FORMATS)}", fmt)
        return fmt

    def index_format(self, arg: str, fmt) -> layout.IndexFormat:
        """One of ``layout.INDEX_FORMATS`` (the ops' trampolines have resolved a known name to it)."""
        if type(fmt) is not layout.IndexFormat:
            self.fail(arg, f"one of {list(layout.INDEX_FORMATS)}", fmt)
        return fmt

    def index_cache(self, arg: str, cache, page_size: int, fmt: layout.IndexFormat) -> None:
        """An indexer key cache: uint8, 2-D, contiguous, at least one page, page stride ``>=
        page_size * token_bytes`` and a multiple of ``layout.INDEX_ALIGN``."""
        need = page_size * fmt.token_bytes
        if (isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8 and cache.dim() == 2
                and cache.is_contiguous() and cache.shape[0] >= 1 and cache.shape[1] >= need
                and cache.shape[1] % layout.INDEX_ALIGN == 0):
            return
        self.fail(
            arg,
            f"a contiguous uint8 index cache [num_pages >= 1, page_stride] with page_stride >= "
            f"page_size*{fmt.token_bytes}={need} ({fmt.name}) and a multiple of {layout.INDEX_ALIGN} "
            f"(canonical: dsv4_compile.layout.alloc_index_cache)",
            f"{_describe(cache)} with strides {tuple(cache.stride())}" if isinstance(cache, torch.Tensor) else cache,
            ValueError if isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8 else TypeError,
        )

    def cache(self, arg: str, cache, page_size: int, fmt: layout.CacheFormat = layout.V4) -> None:
        """The base cache tensor: uint8, 2-D, contiguous, page stride >= page_size * token bytes."""
        token = fmt.token_bytes
        if isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8 and cache.is_contiguous():
            size = cache.shape
            if len(size) == 2 and size[0] >= 1 and size[1] >= page_size * token:
                return
        expected = (
            f"the uint8 base cache tensor [num_pages, >= page_size*{token}={page_size * token}] "
            f"({fmt.name})"
        )
        if not isinstance(cache, torch.Tensor):
            self.fail(arg, expected, cache, TypeError)
        if cache.dtype != torch.uint8 or cache.dim() != 2:
            raise (TypeError if cache.dtype != torch.uint8 else ValueError)(
                f"dsv4.{self.op}: {arg} must be {expected} "
                f"(canonical: dsv4_compile.alloc_cache -> uint8 [num_pages, page_bytes({page_size})="
                f"{fmt.page_bytes(page_size)}]), got {_describe(cache)}; pass the base tensor the "
                f"view was made from, not a dtype or 4-D view of it"
            )
        if cache.shape[1] < page_size * token:
            self.fail(arg, expected, cache)
        if cache.shape[0] < 1:
            self.fail(arg, f"{expected} with at least one page", cache)
        self.fail(
            arg,
            f"{expected} and contiguous (its row length is the page stride); pass the base "
            f"tensor, not a slice of it",
            f"{_describe(cache)} with strides {tuple(cache.stride())}",
        )

    def lengths_within(self, arg: str, lengths, width: int) -> None:
        """Data check: ``0 <= lengths <= width``."""
        if lengths is None or lengths.numel() == 0:
            return
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > width:
            self.fail(arg, f"within [0, {width}] (the index width)", f"values in [{lo}, {hi}]")

    def slots_valid(
        self, arg: str, slots: torch.Tensor, cap: int, counted: torch.Tensor | None = None,
        holes: str = "-1", cap_name: str = "num_pages*page_size",
    ) -> None:
        """Data check: every counted slot is ``-1`` (or any negative, ``holes="negative"``) or
        ``< cap`` (``cap_name`` says what bounds it)."""
        bad = slots >= cap
        if holes == "-1":
            bad |= slots < -1
        if counted is not None:
            bad &= counted
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            allowed = "-1" if holes == "-1" else "negative (skip)"
            self.fail(
                arg,
                f"{allowed} or a slot in [0, {cap}) ({cap_name})",
                f"{int(slots[where])} at {list(where)}",
            )


def counted_mask(indices: torch.Tensor, topk_length: torch.Tensor | None) -> torch.Tensor | None:
    """``[..., K]`` bool: entry ``j`` of a row counts iff ``j < topk_length`` of its batch row."""
    if topk_length is None:
        return None
    width = indices.shape[-1]
    j = torch.arange(width, device=indices.device)
    lengths = topk_length.view(-1, *([1] * (indices.dim() - 1)))
    return j < lengths


read_environment()
