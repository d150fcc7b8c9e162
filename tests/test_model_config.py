"""Configuration (DSV4-Flash numbers, validation) and the RoPE tables."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_compile.models import DeepseekV4Config, apply_rope, layer_rope_table, tiny_config
from dsv4_compile.models.rope import inv_freq, rope_full_width, rope_last


def test_defaults_are_dsv4_flash():
    c = DeepseekV4Config()
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.head_dim) == (4096, 64, 1024, 512)
    assert (c.o_lora_rank, c.o_groups, c.sliding_window) == (1024, 8, 128)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 512)
    assert (c.rope_theta, c.compress_rope_theta, c.rope_factor) == (10000, 160000, 16)
    assert (c.original_max_position_embeddings, c.rms_norm_eps) == (65536, 1e-6)
    assert c.compress_ratios[:6] == (0, 0, 4, 128, 4, 128)
    assert len(c.compress_ratios) == c.num_hidden_layers + 1 == 44  # + the MTP layer


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(head_dim=256), "head_dim must be 512"),
        (dict(num_attention_heads=6, o_groups=4), "multiple of o_groups"),
        (dict(compress_ratios=(0, 8, 128)), "compress_ratios must be in"),
        (dict(num_hidden_layers=4), "one entry per layer"),
        (dict(index_head_dim=96), "index_head_dim must be 128"),
        (dict(index_head_dim=256), "index_head_dim must be 128"),  # a power of two the key cache cannot hold
    ],
)
def test_config_rejects_what_the_layout_cannot_hold(change, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**change)


def test_fewer_heads_are_legal():
    assert tiny_config(num_attention_heads=2, o_groups=1).num_attention_heads == 2


def yarn_reference(base, factor, original, beta_fast, beta_slow, dim=64):
    """DSV4's YaRN blend, written out in float64."""
    i = torch.arange(dim // 2, dtype=torch.float64)
    f = base ** (-2 * i / dim)

    def correction(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(correction(beta_fast)), 0), min(math.ceil(correction(beta_slow)), dim - 1)
    ramp = ((i - lo) / (hi - lo)).clamp(0, 1)
    return f * (1 - ramp) + f / factor * ramp


def test_yarn_keeps_fast_dims_and_interpolates_slow_ones():
    c = DeepseekV4Config()
    got = inv_freq(64, c.compress_rope_theta, factor=16, original_max_pos=65536)
    want = yarn_reference(c.compress_rope_theta, 16, 65536, c.beta_fast, c.beta_slow)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    plain = inv_freq(64, c.compress_rope_theta)
    assert got[0] == plain[0] and torch.allclose(got[-1], plain[-1] / 16)


def test_layer_tables_by_kind():
    c = tiny_config()
    window, compressed = layer_rope_table(c, 0), layer_rope_table(c, 4)
    assert layer_rope_table(c, 128) is compressed  # built once, shared by every compressed layer
    assert window.shape == (c.max_position_embeddings, 64) and window.dtype == torch.float32
    pos = torch.tensor([0, 1, 1000, 4095])
    for table, freqs in (
        (window, c.rope_theta ** (-torch.arange(32, dtype=torch.float64) * 2 / 64)),  # no YaRN
        (compressed, yarn_reference(c.compress_rope_theta, 16, 65536, 32, 1)),
    ):
        angle = pos[:, None].double() * freqs
        want = torch.stack([angle.cos(), angle.sin()], -1).flatten(-2)
        torch.testing.assert_close(table[pos].double(), want, atol=2e-4, rtol=0)  # float32 angles


def test_inverse_rope_undoes_rope():
    table = layer_rope_table(tiny_config(), 4)
    x, pos = torch.randn(5, 3, 64), torch.tensor([0, 7, 99, 1000, 4000])
    back = apply_rope(apply_rope(x, table, pos), table, pos, inverse=True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
    # pairs are (2i, 2i+1): position 1 rotates the first pair by f_0 = 1 radian
    e0 = torch.zeros(1, 64)
    e0[0, 0] = 1
    rotated = apply_rope(e0, table, torch.tensor([1]))
    torch.testing.assert_close(rotated[0, :2], torch.tensor([math.cos(1.0), math.sin(1.0)]))


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(5, 512), (5, 3, 512), (4, 2, 128), (3, 64), (0, 3, 512)])
def test_rope_last_rotates_the_last_dims_as_apply_rope_does_bit_for_bit(shape, inverse):
    """Both forms (the eager tail rotation and the full-width one Inductor compiles), eagerly."""
    table = layer_rope_table(tiny_config(), 4)
    x = 3 * torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    x.view(-1)[:7] = float("nan")  # a NaN moves nothing into another pair or into the pass-through dims
    pos = torch.arange(shape[0]) * 37
    want = torch.cat([x[..., :-64].float(), apply_rope(x[..., -64:], table, pos, inverse=inverse)], -1)
    for got in (rope_last(x, table, pos, inverse=inverse), rope_full_width(x, table, pos, inverse=inverse)):
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_rope_last_dtype_and_in_place():
    """``dtype``: the float32 result rounded once; ``in_place``: eagerly, ``x`` itself rotated."""
    table = layer_rope_table(tiny_config(), 4)
    x = 3 * torch.randn(6, 4, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    pos = torch.arange(6) * 11
    rounded = rope_last(x, table, pos, inverse=True).bfloat16()
    assert torch.equal(rope_last(x, table, pos, inverse=True, dtype=torch.bfloat16).view(torch.int16),
                       rounded.view(torch.int16))
    mine = x.clone()
    got = rope_last(mine, table, pos, inverse=True, dtype=torch.bfloat16, in_place=True)
    assert got.data_ptr() == mine.data_ptr() and torch.equal(got.view(torch.int16), rounded.view(torch.int16))
    kept = x.clone()  # a dtype other than x's: a copy, x untouched
    rope_last(kept, table, pos, in_place=True)
    assert torch.equal(kept.view(torch.int16), x.view(torch.int16))


def test_rope_last_compiled_writes_no_input_and_matches_eager():
    """Compiled, ``rope_last`` (there :func:`rope_full_width`, fused by Inductor) is within float32
    rounding of the eager result, and ``in_place`` does not make it write its input."""
    table = layer_rope_table(tiny_config(), 4)
    x = torch.randn(5, 3, 512, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(5) * 7
    before = x.clone()
    compiled = torch.compile(lambda x, p: rope_last(x, table, p, inverse=True, in_place=True), fullgraph=True)
    got = compiled(x, pos)
    assert torch.equal(x, before)
    torch.testing.assert_close(got, rope_last(x.clone(), table, pos, inverse=True), atol=1e-6, rtol=1e-6)
