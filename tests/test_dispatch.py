"""Provider resolution, the override switch, fallback warnings and checked mode."""

import gc
import warnings
import weakref

import pytest
import torch

import dsv4_compile as d4
from dsv4_compile import checks, dispatch
from dsv4_compile.providers import reference
from dsv4_compile.ops.decode import decode_outputs, metadata_outputs

from helpers import filled_cache, random_indices


def test_cpu_is_served_by_the_reference():
    assert d4.providers("cpu") == {op: "reference" for op in dispatch.OPS}


@pytest.fixture
def fake_provider():
    """A CPU provider above the reference that records its calls and delegates to the reference."""
    calls = []

    def load(device):
        def decode(*args):
            calls.append(device)
            return reference.flash_mla_with_kvcache(*args)

        return {"flash_mla_with_kvcache": decode}

    dispatch.register_provider(dispatch.Provider("recording", "cpu", load, priority=10))
    yield calls
    dispatch.unregister_provider("recording", "cpu")


def decode_once():
    cache, _ = filled_cache(2, 4)
    q = torch.randn(1, 1, 4, 512, dtype=torch.bfloat16)
    return d4.flash_mla_with_kvcache(q, cache, 4, random_indices((1, 1, 5), 8))


def test_higher_priority_provider_serves_its_ops(fake_provider):
    assert d4.providers("cpu")["flash_mla_with_kvcache"] == "recording"
    assert d4.providers("cpu")["flash_mla_sparse_fwd"] == "reference"  # it does not implement prefill
    decode_once()
    assert fake_provider == [torch.device("cpu")]


def test_use_provider_forces_the_reference(fake_provider):
    with d4.use_provider("reference"):
        assert d4.providers("cpu")["flash_mla_with_kvcache"] == "reference"
        decode_once()
    assert fake_provider == []
    with d4.use_provider("reference", ops=("flash_mla_sparse_fwd",)):
        decode_once()
    assert len(fake_provider) == 1


def test_env_override_is_read_at_reset(monkeypatch, fake_provider):
    monkeypatch.setenv(dispatch.PROVIDER_ENV, "flash_mla_with_kvcache=reference")
    assert d4.providers("cpu")["flash_mla_with_kvcache"] == "recording"  # not read per call
    dispatch.reset()
    assert d4.providers("cpu")["flash_mla_with_kvcache"] == "reference"
    monkeypatch.setenv(dispatch.PROVIDER_ENV, "reference")
    dispatch.reset()
    assert d4.providers("cpu")["flash_mla_with_kvcache"] == "reference"
    monkeypatch.setenv(dispatch.PROVIDER_ENV, "nonsense_op=reference")
    with pytest.raises(ValueError, match="nonsense_op"):
        dispatch.reset()
    monkeypatch.delenv(dispatch.PROVIDER_ENV)
    dispatch.reset()


@pytest.mark.parametrize("op", ["get_mla_metadata", "get_mla_metadata_stacked"])
def test_metadata_follows_the_decode_override(op):
    with d4.use_provider("reference", ops=("flash_mla_with_kvcache",)):
        assert dispatch.forced_providers()[op] == "reference"
    with pytest.raises(ValueError, match=f"{op} follows flash_mla_with_kvcache"):
        with d4.use_provider("reference", ops=(op,)):
            pass


def test_forcing_an_unregistered_provider_is_an_error():
    with d4.use_provider("flashmla"):
        with pytest.raises(d4.ProviderUnavailable, match="flashmla"):
            decode_once()


def test_unknown_op_in_override():
    with pytest.raises(ValueError, match="unknown op"):
        with d4.use_provider("reference", ops=("flash_attn",)):
            pass


def test_unavailable_provider_falls_back_with_one_warning():
    def load(device):
        raise dispatch.ProviderUnavailable("libfoo is not installed: pip install foo")

    dispatch.register_provider(dispatch.Provider("foo", "cpu", load, priority=5))
    try:
        with pytest.warns(RuntimeWarning, match="libfoo is not installed"):
            decode_once()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            decode_once()  # warned once only
        with d4.use_provider("foo"):
            with pytest.raises(d4.ProviderUnavailable, match="libfoo"):
                decode_once()
    finally:
        dispatch.unregister_provider("foo", "cpu")
        dispatch.reset()


def test_an_unavailable_provider_keeps_no_caller_alive():
    """Why a provider is unavailable is kept, not the exception: its traceback would hold the
    frames of the first call that tried it, and their tensors (in a CUDA-graph warm-up, tensors of
    the graph's pool, which the graph then refuses to record)."""
    def load(device):
        raise dispatch.ProviderUnavailable("libfoo is not installed: pip install foo")

    def first_call():
        local = torch.ones(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            decode_once()  # loads foo (refused), then serves the call by the reference
        return weakref.ref(local)

    dispatch.register_provider(dispatch.Provider("foo", "cpu", load, priority=5))
    try:
        local = first_call()
        gc.collect()
        assert local() is None
        with d4.use_provider("foo"):  # the stored reason, raised afresh
            with pytest.raises(d4.ProviderUnavailable, match="libfoo is not installed"):
                decode_once()
    finally:
        dispatch.unregister_provider("foo", "cpu")
        dispatch.reset()


def test_checked_mode_switches():
    assert not d4.checked_mode()
    with d4.checked():
        assert d4.checked_mode()
        with d4.checked(False):
            assert not d4.checked_mode()
    assert not d4.checked_mode()


def test_checked_mode_env_is_read_at_reset(monkeypatch):
    monkeypatch.setenv(checks.CHECKED_ENV, "1")
    assert not d4.checked_mode()
    dispatch.reset()
    assert d4.checked_mode()
    monkeypatch.setenv(checks.CHECKED_ENV, "0")
    dispatch.reset()
    assert not d4.checked_mode()


def test_data_checks_run_for_the_reference_and_in_checked_mode_only():
    """The reference indexes with the values: it always gets them checked; another provider only
    in checked mode (a device sync on a GPU)."""

    calls = []

    def decode(q, *args):
        calls.append(q)
        return decode_outputs(q, 512)

    dispatch.register_provider(dispatch.Provider("unchecked", "cpu", lambda d: {"flash_mla_with_kvcache": decode},
                                                 priority=10))
    try:
        cache, _ = filled_cache(2, 4)
        q = torch.randn(1, 1, 4, 512, dtype=torch.bfloat16)
        bad = torch.tensor([[[0, 8]]], dtype=torch.int32)  # 8 == capacity
        d4.flash_mla_with_kvcache(q, cache, 4, bad)  # not checked: no sync
        assert len(calls) == 1
        with d4.checked(), pytest.raises(ValueError, match="indices must be -1 or a slot in"):
            d4.flash_mla_with_kvcache(q, cache, 4, bad)
        with d4.use_provider("reference"), pytest.raises(ValueError, match="indices must be -1 or a slot in"):
            d4.flash_mla_with_kvcache(q, cache, 4, bad)
        assert len(calls) == 1
    finally:
        dispatch.unregister_provider("unchecked", "cpu")


def test_redispatch_to_a_device_key_resolves_that_device_type():
    """The kernel bound to the XPU key resolves XPU providers even for CPU tensors."""
    seen = []

    def load(device):
        seen.append(device.type)
        return {"get_mla_metadata": reference.get_mla_metadata}

    dispatch.register_provider(dispatch.Provider("probe", "xpu", load, priority=5))
    try:
        q = torch.randn(1, 1, 8, 512, dtype=torch.bfloat16)
        ks = torch._C.DispatchKeySet(torch._C.DispatchKey.XPU)
        torch.ops.dsv4.get_mla_metadata.default.redispatch(ks, q, random_indices((1, 1, 4), 8), None, None, None)
        assert seen == ["xpu"]
    finally:
        dispatch.unregister_provider("probe", "xpu")


def test_compiled_metadata_runs_under_another_provider():
    """get_mla_metadata's outputs have one geometry per device type whatever the provider, so a
    step compiled while a scheduler provider served it runs under ``use_provider("reference")``
    (the reference returns zeros of that geometry; its decode ignores them)."""

    seen = []

    def scheduler(q, indices, topk_length, extra_indices, extra_topk_length):
        meta, splits = metadata_outputs(q)
        return meta.fill_(7), splits.fill_(7)

    def decode(*args):
        seen.append(int(args[10].sum()))
        return reference.flash_mla_with_kvcache(*args)

    dispatch.register_metadata_shapes("cpu", lambda device, batch, s_q, heads: ((3, 8), (batch + 1,)))
    dispatch.register_provider(dispatch.Provider(
        "scheduler", "cpu", lambda d: {"get_mla_metadata": scheduler, "flash_mla_with_kvcache": decode}, priority=10,
    ))
    try:
        cache, _ = filled_cache(2, 4)
        q = torch.randn(2, 1, 4, 512, dtype=torch.bfloat16)
        idx = random_indices((2, 1, 5), 8)

        def step(q, idx):
            meta, splits = d4.get_mla_metadata(q, idx)
            return d4.flash_mla_with_kvcache(q, cache, 4, idx, tile_scheduler_metadata=meta, num_splits=splits)

        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True)
        with torch.no_grad():
            scheduled = compiled(q, idx)
            with d4.use_provider("reference"):
                plain = compiled(q, idx)
        assert seen == [7 * 3 * 8]  # the scheduler's metadata reached its decode, once
        assert torch.equal(scheduled[0], plain[0]) and torch.equal(scheduled[1], plain[1])
    finally:
        dispatch.unregister_provider("scheduler", "cpu")
        dispatch.register_metadata_shapes("cpu", None)
        torch._dynamo.reset()
