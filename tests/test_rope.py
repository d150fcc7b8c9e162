"""``dsv4::rope_``: the reference against float64, the Triton kernel against the reference bit for
bit, bad inputs, empty calls, ``torch.compile``.

The Triton kernel runs on CPU under ``TRITON_INTERPRET=1`` in the child pytest of
:func:`test_interpreted_suite` and compiled on CUDA (``cuda`` marker). It computes the reference's
float32 operations in the reference's order, each rounded on its own (its launch turns off
multiply-add contraction), then rounds once to ``x``'s dtype: so its bits are the reference's.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from helpers import patch_triton_interpreter, run_interpreted_child

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    patch_triton_interpreter()

import dsv4_compile as d4  # noqa: E402
from dsv4_compile import layout  # noqa: E402

OP = torch.ops.dsv4.rope_.default
TRITON_DEVICES = ["cpu"] if INTERPRETED else [pytest.param("cuda", marks=pytest.mark.cuda)]
not_interpreted = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")
EPS32 = torch.finfo(torch.float32).eps

#: x's shape: the attention output [T, H, 512]; a 2-D row; an odd width (the rotated pairs start
#: at an odd dim); rows that do not fill a program; exactly 64 dims
SHAPES = {"heads": (5, 16, 512), "rows": (7, 512), "odd_width": (3, 5, 101), "ragged": (33, 3, 64)}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def inputs(shape, dtype, device="cpu", max_pos=300, index_dtype=torch.int64):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 4).to(device=device, dtype=dtype)
    angles = torch.rand(max_pos, layout.ROPE_DIM // 2, generator=g) * 100
    freqs = torch.stack([angles.cos(), angles.sin()], -1).flatten(-2).to(device)
    positions = torch.randint(0, max_pos, shape[:1], generator=g).to(device=device, dtype=index_dtype)
    return x, freqs, positions


def float64_rotation(x, freqs, positions, inverse):
    """The rotated tail in float64 (exact products of the float32 inputs, one rounding per sum)
    and the float32 error bound of a float32 evaluation: ``2 eps (|a c| + |b s|)`` per value."""
    pairs = x[..., -layout.ROPE_DIM:].double().cpu().unflatten(-1, (-1, 2))
    cs = freqs.double().cpu()[positions.cpu().long()].view(-1, *([1] * (x.dim() - 2)), layout.ROPE_DIM // 2, 2)
    cos, sin = cs[..., 0], cs[..., 1] * (-1 if inverse else 1)
    a, b = pairs[..., 0], pairs[..., 1]
    exact = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    bound = torch.stack([(a * cos).abs() + (b * sin).abs(), (a * sin).abs() + (b * cos).abs()], -1).flatten(-2)
    return exact, 2 * EPS32 * bound


@not_interpreted
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_against_float64(shape, dtype, inverse):
    """The rotated dims are the exact rotation rounded to ``x``'s dtype (within float32's error
    first); every other dim keeps its bits."""
    x, freqs, positions = inputs(SHAPES[shape], dtype)
    before = x.clone()
    with d4.use_provider("reference"):
        d4.rope_(x, freqs, positions, inverse)
    exact, bound = float64_rotation(before, freqs, positions, inverse)
    got = x[..., -layout.ROPE_DIM:].double()
    half_ulp = exact.abs() * (torch.finfo(dtype).eps / 2)  # the final rounding to dtype
    assert ((got - exact).abs() <= half_ulp + bound * (1 + torch.finfo(dtype).eps)).all()
    assert torch.equal(x[..., : -layout.ROPE_DIM], before[..., : -layout.ROPE_DIM])


@not_interpreted
def test_inverse_undoes_the_rotation():
    x, freqs, positions = inputs((6, 4, 512), torch.float32)
    y = x.clone()
    d4.rope_(y, freqs, positions)
    assert not torch.allclose(y, x)
    d4.rope_(y, freqs, positions, inverse=True)
    torch.testing.assert_close(y, x, atol=4e-6 * x.abs().max().item(), rtol=0)


@not_interpreted
def test_reference_rotates_in_blocks_of_tokens(monkeypatch):
    """The reference's float32 temporaries stay within ``CHUNK_BYTES``: several blocks of tokens,
    the same bits as one."""
    from dsv4_compile.providers import reference

    x, freqs, positions = inputs((9, 4, 512), torch.bfloat16)
    whole = x.clone()
    with d4.use_provider("reference"):
        d4.rope_(whole, freqs, positions, True)
        monkeypatch.setattr(reference, "CHUNK_BYTES", 24 * 4 * 64 * 2)  # two tokens a block
        d4.rope_(x, freqs, positions, True)
    assert torch.equal(x, whole)


# --------------------------------------------------------------------------------------------
# The Triton kernel (interpreted on CPU in the child, compiled on CUDA)
# --------------------------------------------------------------------------------------------


def triton_rope_(x, freqs, positions, inverse):
    """The Triton provider's kernel: through the op on CUDA (where it serves), directly when
    interpreted on CPU (where the reference serves the op)."""
    if x.device.type == "cuda":
        assert d4.providers("cuda")["rope_"] == "triton"
        return d4.rope_(x, freqs, positions, inverse)
    from dsv4_compile.providers.triton import rope as triton_rope

    d4.ops.rope.check_rope(x, freqs, positions, inverse)
    return triton_rope.rope_(x, freqs, positions, inverse)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_triton_equals_reference(shape, dtype, inverse, device):
    x, freqs, positions = inputs(SHAPES[shape], dtype, device, index_dtype=torch.int32)
    expected = x.clone()
    with d4.use_provider("reference"):
        d4.rope_(expected, freqs, positions, inverse)
    triton_rope_(x, freqs, positions, inverse)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_writes_only_the_rotated_dims_of_strided_rows(device):
    """``x`` a view into a wider buffer (heads apart, tokens apart, as ``[T, 1, H, D]`` squeezed
    or a slice): the buffer's other bytes, NaN here, stay as they were; a transposed (head-major)
    view is rotated as its rows say."""
    buffer = torch.full((4, 3, 6, 520), float("nan"), dtype=torch.bfloat16, device=device)
    x = buffer[:, 1, 1:5, :512]  # [4, 4, 512], strides (3*6*520, 520, 1)
    x.copy_(torch.randn(4, 4, 512))
    _, freqs, positions = inputs((4, 4, 512), torch.bfloat16, device)
    expected = x.clone()
    with d4.use_provider("reference"):
        d4.rope_(expected, freqs, positions, True)
    kept = buffer.clone()
    triton_rope_(x, freqs, positions, True)
    assert torch.equal(x, expected)
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[:, 1, 1:5, 512 - layout.ROPE_DIM : 512] = False
    assert torch.equal(buffer[outside].view(torch.int16), kept[outside].view(torch.int16))

    head_major = torch.randn(4, 5, 64, dtype=torch.float32, device=device).transpose(0, 1)  # [5, 4, 64]
    expected = head_major.clone()
    positions = positions[:1].expand(5).contiguous()
    with d4.use_provider("reference"):
        d4.rope_(expected, freqs, positions)
    triton_rope_(head_major, freqs, positions, False)
    assert torch.equal(head_major, expected)


@not_interpreted
def test_interpreted_suite(request):
    """Run this file's Triton tests on CPU in a child pytest with ``TRITON_INTERPRET=1``."""
    run_interpreted_child(request.config, __file__)


# --------------------------------------------------------------------------------------------
# The op: empty calls, errors, checked mode, compile
# --------------------------------------------------------------------------------------------


@not_interpreted
@pytest.mark.parametrize("shape", [(0, 512), (0, 4, 512), (3, 0, 512)])
def test_empty_calls_do_nothing(shape):
    _, freqs, _ = inputs((1, 512), torch.bfloat16)
    x, positions = torch.empty(shape, dtype=torch.bfloat16), torch.zeros(shape[0], dtype=torch.int64)
    d4.rope_(x, freqs, positions)
    OP(x, freqs, positions, True)


def _bad_calls():
    x, freqs, positions = inputs((3, 2, 512), torch.bfloat16)
    yield "x", (x.int(), freqs, positions, False), "bfloat16/float16/float32 [T, D] or [T, H, D]"
    yield "x", (x[0, 0], freqs, positions, False), "[T, D] or [T, H, D] with D >= 64, got bfloat16 [512]"
    yield "x", (x[..., :63], freqs, positions, False), "D >= 64, got bfloat16 [3, 2, 63]"
    yield "x", (torch.randn(3, 2, 1024).bfloat16()[..., ::2], freqs, positions, False), "last-dim contiguous"
    yield "x", (x[:, :1].expand(3, 2, 512), freqs, positions, False), "do not overlap"
    yield "freqs", (x, freqs[:, :32], positions, False), "float32 [*, 64]"
    yield "freqs", (x, freqs.double(), positions, False), "float32 [*, 64]"
    yield "positions", (x, freqs, positions[:2], False), "int32/int64 [3]"
    yield "positions", (x, freqs, positions.float(), False), "int32/int64 [3]"
    yield "inverse", (x, freqs, positions, 1), "a bool"  # (the dispatcher itself reads 1 as True)


@not_interpreted
@pytest.mark.parametrize("arg,args,expected", list(_bad_calls()))
def test_bad_inputs_are_named_and_nothing_is_written(arg, args, expected):
    x = args[0]
    before = x.clone()
    for call in (d4.rope_, OP) if arg != "inverse" else (d4.rope_,):
        with pytest.raises((TypeError, ValueError), match=rf"dsv4\.rope_: {arg} must be .*{re.escape(expected)}"):
            call(*args)
        assert torch.equal(x, before)


@not_interpreted
def test_positions_out_of_range_in_checked_mode():
    """Outside ``freqs``: an error naming ``positions`` from the checked mode (and from the
    reference, which checks data always); ``x`` unchanged."""
    x, freqs, positions = inputs((3, 2, 512), torch.bfloat16, max_pos=8)
    before = x.clone()
    positions[1] = 8
    with d4.checked(), pytest.raises(ValueError, match=r"dsv4\.rope_: positions must be within \[0, 8\)"):
        d4.rope_(x, freqs, positions)
    positions[1] = -1
    with d4.use_provider("reference"), pytest.raises(ValueError, match=r"positions must be within"):
        d4.rope_(x, freqs, positions)
    assert torch.equal(x, before)


@not_interpreted
def test_compiled_in_place_on_an_intermediate_equals_eager():
    """Under ``torch.compile`` (one graph, no break) the op rotates a temporary the graph made, in
    place, as eagerly: Inductor calls it on the graph's one buffer, which it returns (no copy for
    the op to write); the graph's input is not written."""
    from torch._inductor.utils import run_and_get_code

    def f(y, freqs, positions):
        out = y * 2
        d4.rope_(out, freqs, positions, True)
        return out.view(y.shape[0], -1)

    x, freqs, positions = inputs((5, 4, 512), torch.bfloat16)
    kept = x.clone()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    got, (code, *_) = run_and_get_code(torch.compile(f, fullgraph=True), x, freqs, positions)
    assert torch.equal(got, f(x, freqs, positions))
    assert torch.equal(x, kept)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    call = code[code.index("def call"):]
    rotated = re.search(r"torch\.ops\.dsv4\.rope_\.default\((\w+),", call)
    assert rotated and call.count("empty_strided") == 1, call
    assert re.search(rf"return \(.*\b{rotated[1]}\b", call), call
