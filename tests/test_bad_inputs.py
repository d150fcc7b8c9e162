"""Malformed calls: a clear error naming the argument, and not one cache byte changed."""

import re

import pytest
import torch

import dsv4_compile as d4

from helpers import filled_cache, rope_table, store_inputs

STORE = torch.ops.dsv4.fused_k_norm_rope_flashmla.default
DECODE = torch.ops.dsv4.flash_mla_with_kvcache.default
PREFILL = torch.ops.dsv4.flash_mla_sparse_fwd.default
META = torch.ops.dsv4.get_mla_metadata.default
P = 16


def store_args(**over):
    kv, w, freqs, pos = store_inputs(4, max_pos=64)
    args = dict(kv=kv, kv_weight=w, freqs=freqs, positions=pos, out_loc=torch.tensor([0, 5, 17, -1]),
                kvcache=None, eps=1e-6, page_size=P)
    args.update(over)
    return args


def decode_args(**over):
    q = torch.randn(2, 1, 8, 512, dtype=torch.bfloat16)
    args = dict(q=q, k_cache=None, page_size=P, indices=torch.tensor([[[0, 3, -1]], [[5, 6, 7]]], dtype=torch.int32),
                topk_length=None, attn_sink=None, extra_k_cache=None, extra_page_size=1, extra_indices=None,
                extra_topk_length=None, tile_scheduler_metadata=None, num_splits=None, softmax_scale=0.1, head_dim_v=512)
    args.update(over)
    return args


def prefill_args(**over):
    args = dict(q=torch.randn(3, 8, 512, dtype=torch.bfloat16), kv=torch.randn(6, 1, 512, dtype=torch.bfloat16),
                indices=torch.zeros(3, 1, 4, dtype=torch.int32), sm_scale=0.1, d_v=512, attn_sink=None, topk_length=None)
    args.update(over)
    return args


# (op, overrides, exception, argument named in the message)
CASES = [
    # the store
    ("store", dict(kv=torch.randn(4, 576, dtype=torch.bfloat16)), ValueError, "kv"),
    ("store", dict(kv=torch.randn(4, 512, dtype=torch.float64)), TypeError, "kv"),
    ("store", dict(kv=torch.randn(512, 4, dtype=torch.bfloat16).t()), ValueError, "kv"),
    ("store", dict(kv_weight=torch.ones(512, dtype=torch.float16)), TypeError, "kv_weight"),
    ("store", dict(freqs=rope_table(64).double()), TypeError, "freqs"),
    ("store", dict(freqs=torch.randn(64, 32, dtype=torch.complex64)), TypeError, "freqs"),
    ("store", dict(positions=torch.zeros(3, dtype=torch.int64)), ValueError, "positions"),
    ("store", dict(positions=torch.zeros(4)), TypeError, "positions"),
    ("store", dict(out_loc=torch.zeros(4, dtype=torch.int16)), TypeError, "out_loc"),
    ("store", dict(out_loc=torch.tensor([0, 5, 32, -1])), ValueError, "out_loc"),  # == capacity
    ("store", dict(positions=torch.tensor([0, 1, 64, 2])), ValueError, "positions"),  # past freqs
    ("store", dict(page_size=0), ValueError, "page_size"),
    ("store", dict(page_size=64), ValueError, "kvcache"),  # page stride too small for 64 tokens
    ("store", dict(kvcache="fp8view"), TypeError, "kvcache"),
    ("store", dict(kvcache="sliced"), ValueError, "kvcache"),
    ("store", dict(eps=-1.0), ValueError, "eps"),
    # the decode
    ("decode", dict(q=torch.randn(2, 1, 8, 512)), TypeError, "q"),
    ("decode", dict(q=torch.randn(2, 8, 576, dtype=torch.bfloat16)), ValueError, "q"),
    ("decode", dict(k_cache="fp8view"), TypeError, "k_cache"),
    ("decode", dict(indices=torch.zeros(2, 1, 3, dtype=torch.int64)), TypeError, "indices"),
    ("decode", dict(indices=torch.zeros(3, 1, 3, dtype=torch.int32)), ValueError, "indices"),
    ("decode", dict(indices=torch.tensor([[[0, 3, 32]], [[5, 6, 7]]], dtype=torch.int32)), ValueError, "indices"),
    ("decode", dict(indices=torch.tensor([[[0, -2, 1]], [[5, 6, 7]]], dtype=torch.int32)), ValueError, "indices"),
    ("decode", dict(topk_length=torch.tensor([4, 1], dtype=torch.int32)), ValueError, "topk_length"),
    ("decode", dict(topk_length=torch.tensor([1, 1])), TypeError, "topk_length"),
    ("decode", dict(attn_sink=torch.zeros(4)), ValueError, "attn_sink"),
    ("decode", dict(attn_sink=torch.zeros(8, dtype=torch.bfloat16)), TypeError, "attn_sink"),
    ("decode", dict(extra_indices=torch.zeros(2, 1, 3, dtype=torch.int32)), ValueError, "extra_indices"),
    ("decode", dict(extra_k_cache="cache", extra_page_size=2), ValueError, "extra_indices"),
    ("decode", dict(extra_k_cache="cache", extra_page_size=0, extra_indices=torch.zeros(2, 1, 3, dtype=torch.int32)), ValueError, "extra_page_size"),
    ("decode", dict(tile_scheduler_metadata=torch.zeros(4, 8, dtype=torch.int32)), ValueError, "num_splits"),
    ("decode", dict(head_dim_v=448), ValueError, "head_dim_v"),
    ("decode", dict(page_size=-3), ValueError, "page_size"),
    # the prefill
    ("prefill", dict(kv=torch.randn(6, 512, dtype=torch.bfloat16)), ValueError, "kv"),
    ("prefill", dict(indices=torch.zeros(3, 2, 4, dtype=torch.int32)), ValueError, "indices"),
    ("prefill", dict(topk_length=torch.tensor([1, 5, 2], dtype=torch.int32)), ValueError, "topk_length"),
    ("prefill", dict(d_v=256), ValueError, "d_v"),
    ("prefill", dict(q=torch.randn(3, 8, 512, dtype=torch.float16)), TypeError, "q"),
]


def resolve_cache(value, cache):
    if value == "fp8view":
        return d4.flashmla_view(cache, P)
    if value == "sliced":
        return cache[:, : P * 584]
    return cache if value is None else value


@pytest.mark.parametrize("op,over,exc,arg", CASES, ids=[f"{c[0]}-{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_rejected_with_named_argument_and_cache_untouched(op, over, exc, arg):
    cache, _ = filled_cache(2, P)
    extra, _ = filled_cache(2, 2)
    before, extra_before = cache.clone(), extra.clone()
    if op == "store":
        args = store_args(**over)
        args["kvcache"] = resolve_cache(args["kvcache"], cache)
        fn = STORE
    elif op == "decode":
        args = decode_args(**over)
        args["k_cache"] = resolve_cache(args["k_cache"], cache)
        if isinstance(args["extra_k_cache"], str):
            args["extra_k_cache"] = extra
        fn = DECODE
    else:
        args, fn = prefill_args(**over), PREFILL
    with pytest.raises(exc) as info:
        fn(*args.values())
    message = str(info.value)
    # the message is about this argument ("dsv4.<op>: <arg> must be ..., got ..."), not one whose
    # name merely contains it (kv / kvcache, indices / extra_indices)
    assert re.search(rf"^dsv4\.\w+: (\S+/)?{re.escape(arg)} must be .*, got ", message), message
    assert torch.equal(cache, before) and torch.equal(extra, extra_before)


def test_error_message_shows_expected_and_actual():
    cache = d4.alloc_cache(12, 256)
    with pytest.raises(TypeError) as info:
        d4.flash_mla_with_kvcache(torch.randn(1, 1, 64, 512, dtype=torch.bfloat16), d4.flashmla_view(cache, 256), 256,
                                  torch.zeros(1, 1, 64, dtype=torch.int32))
    msg = str(info.value)
    assert "uint8" in msg and "149760" in msg and "float8_e4m3fn [12, 256, 1, 584]" in msg and "base tensor" in msg


def test_metadata_rejects_mismatched_indices():
    message = r"^dsv4\.get_mla_metadata: indices must be int32 \[2, 1, \*\], got int32 \[3, 1, 4\]"
    with pytest.raises(ValueError, match=message):
        META(torch.randn(2, 1, 8, 512, dtype=torch.bfloat16), torch.zeros(3, 1, 4, dtype=torch.int32), None, None, None)


@pytest.mark.parametrize(
    "over, arg, expected",
    [
        (dict(topk=[128]), "topk_length", r"a list of 1 entries \(as topk\), got 2 entries"),
        (dict(topk=[128, 2**21]), r"topk\[1\]", r"an int in \[0, 1048576\] \(an index width\), got 2097152"),
        (dict(extra_topk=[0, -1]), r"extra_topk\[1\]", r"an int in \[0, 1048576\] \(an index width\), got -1"),
        (dict(topk_length=[None, torch.zeros(3, dtype=torch.int32)]), r"topk_length\[1\]", r"int32 \[2\], got int32 \[3\]"),
        (dict(extra_topk=[0, 0]), r"extra_topk_length\[1\]", r"None when extra_topk\[1\] is 0"),
        (dict(topk_length=[torch.zeros(2, dtype=torch.int32, device="meta"), None]), r"topk_length\[0\]",
         r"on cpu like q, extra_topk_length\[1\], got meta"),
    ],
)
def test_stacked_metadata_names_the_entry(over, arg, expected):
    """Each list is as long as ``topk``; an entry's error names it with its index."""
    lengths = torch.tensor([3, 4], dtype=torch.int32)
    args = dict(q=torch.randn(2, 1, 8, 512, dtype=torch.bfloat16), topk=[128, 64], topk_length=[lengths, None],
                extra_topk=[0, 512], extra_topk_length=[None, lengths])
    args.update(over)
    with pytest.raises(ValueError, match=rf"^dsv4\.get_mla_metadata_stacked: {arg} must be {expected}"):
        torch.ops.dsv4.get_mla_metadata_stacked.default(*args.values())


def test_fake_raises_the_same_errors():
    """Under FakeTensorMode (what torch.compile traces with) the metadata errors are identical."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = decode_args(k_cache=d4.alloc_cache(2, P), attn_sink=torch.zeros(4))
    with pytest.raises(ValueError) as eager:
        DECODE(*args.values())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args.values()]
        with pytest.raises(ValueError) as fake:
            DECODE(*fake_args)
    assert str(fake.value) == str(eager.value)


def test_grad_inputs_are_rejected():
    args = prefill_args()
    args["q"].requires_grad_()
    with pytest.raises(RuntimeError, match="inference-only"):
        PREFILL(*args.values())
    with torch.no_grad():
        PREFILL(*args.values())


@pytest.mark.parametrize("odd", ["kv", "kv_weight", "kvcache"])
def test_mixed_devices_name_the_odd_one_out(odd):
    """Whichever argument is on another device (the first one included) is the one named."""
    cache, _ = filled_cache(2, P)
    before = cache.clone()
    args = store_args(kvcache=cache)
    args[odd] = args[odd].to("meta")
    with pytest.raises(ValueError) as info:
        STORE(*args.values())
    assert re.search(rf"^dsv4\.\w+: {odd} must be on cpu like .*, got meta$", str(info.value)), str(info.value)
    assert torch.equal(cache, before)


def test_grad_error_names_the_input():
    args = prefill_args()
    args["kv"].requires_grad_()
    with pytest.raises(RuntimeError, match=r"inference-only.*: kv requires grad"):
        PREFILL(*args.values())


@pytest.mark.parametrize("op", ["decode", "prefill", "metadata"])
def test_absurd_index_widths_are_rejected_before_allocating(op):
    """A stride-0 expand makes a 2^31-wide index row cost nothing to build: it must be refused
    from its shape, not by an allocation failure (or hours of work) inside a kernel."""
    wide = 2**31
    cache, _ = filled_cache(2, P)
    if op == "prefill":
        args = prefill_args(indices=torch.zeros(3, 1, 1, dtype=torch.int32).expand(3, 1, wide))
        call_ = lambda: PREFILL(*args.values())  # noqa: E731
    else:
        idx = torch.zeros(2, 1, 1, dtype=torch.int32).expand(2, 1, wide)
        args = decode_args(k_cache=cache, indices=idx)
        if op == "decode":
            call_ = lambda: DECODE(*args.values())  # noqa: E731
        else:
            call_ = lambda: META(args["q"], idx, None, None, None)  # noqa: E731
    with pytest.raises(ValueError, match=r"indices must be at most \d+ index columns wide, got int32 \[.*2147483648\]"):
        call_()
