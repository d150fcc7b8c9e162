"""torch.export programs and AOTInductor packages of the model's steps (dsv4_compile.export).

The packages are built once for the module (minutes of C++ compilation on a small CPU machine);
the round trip loads them in a fresh process that never imports the model's code."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsv4_compile as d4
from dsv4_compile.export import MIN_TORCH, build_package, dsv4_ops, export_step, load_package, packages_supported
from dsv4_compile.generation import generate, prefill_inputs, step_inputs
from dsv4_compile.models import CacheConfig, DeepseekV4Model, tiny_config
from dsv4_compile.tolerances import rerounded_atol
from helpers import assert_same_choices_but_near_ties, assert_steps_close

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "export.py"
STEPS = 4


def example():
    spec = importlib.util.spec_from_file_location("export_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_model() -> DeepseekV4Model:
    """The model of examples/export.py."""
    return DeepseekV4Model(tiny_config(), CacheConfig(max_requests=4, max_seq_len=512), seed=0)


needs_packages = pytest.mark.skipif(
    not packages_supported(), reason=f"AOTInductor packages need torch >= {MIN_TORCH} (see test_packages_refused_before)"
)


@pytest.fixture(scope="module")
def package_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("package")
    build_package(make_model(), directory)
    return directory


@pytest.fixture
def package(package_dir):
    return load_package(package_dir)


def test_program_keeps_the_ops_and_mutates_the_state_buffers():
    model = make_model()
    program = export_step(model, "decode", max_tokens=64)
    assert dsv4_ops(program) == [
        "dsv4::flash_mla_with_kvcache", "dsv4::fused_k_norm_rope_flashmla", "dsv4::get_mla_metadata_stacked",
        "dsv4::indexer_cache_topk", "dsv4::indexer_store", "dsv4::rope_",
    ]
    states = {f"model.{name}" for name in model.state_buffers()}
    assert {spec.target for spec in program.graph_signature.input_specs if spec.kind.name == "BUFFER"} >= states
    # functionalized (what AOTInductor compiles): every cache is a buffer the program writes back
    mutated = {
        spec.target for spec in program.run_decompositions().graph_signature.output_specs
        if spec.kind.name == "BUFFER_MUTATION"
    }
    caches = {s for s in states if s.endswith(("swa_cache", "compressed_cache", "key_cache"))}
    assert caches and caches <= mutated <= states
    # the token and request counts are dynamic, with the declared ranges
    ranges = sorted((r.lower, r.upper) for r in program.range_constraints.values())
    assert ranges == [(1, model.cache.max_requests), (1, 64)]


def test_prefill_program_calls_the_prefill_op():
    assert dsv4_ops(export_step(make_model(), "prefill", max_tokens=64)) == [
        "dsv4::flash_mla_sparse_fwd", "dsv4::fused_k_norm_rope_flashmla", "dsv4::indexer_cache_topk",
        "dsv4::indexer_store", "dsv4::rope_",
    ]


@needs_packages
def test_packages_hold_code_and_the_weights_are_saved_once(package_dir):
    model = make_model()
    state_bytes = sum(b.numel() * b.element_size() for b in model.state_buffers().values())
    for mode in ("prefill", "decode"):  # no cache in them (the states alone are larger)
        assert (package_dir / f"{mode}.pt2").stat().st_size < state_bytes
    weights = torch.load(package_dir / "weights.pt", weights_only=True)
    for name, param in model.named_parameters():
        assert torch.equal(weights[f"model.{name}"], param), name
    assert not set(weights) & {f"model.{name}" for name in model.state_buffers()}


@needs_packages
def test_round_trip_in_a_fresh_process(package_dir, tmp_path):
    """A process that never imports the model's code runs the packages, fed the eager model's
    tokens: its logits of every step are eager's within compiled-code noise, and its greedy
    choices are eager's but where two logits lie within twice that of each other (near-ties)."""
    model = make_model()
    want_logits = []
    with torch.no_grad():
        want = generate(model, model, example().prompts(model.config.vocab_size), STEPS, "cpu",
                        on_step=lambda s, l: want_logits.append(l.float()))
    follow = tmp_path / "tokens.json"
    follow.write_text(json.dumps(want))
    child = subprocess.run(
        [sys.executable, str(EXAMPLE), "--load", str(package_dir), "--steps", str(STEPS), "--follow", str(follow)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert not got["model_code_imported"]
    # a package against the eager model: Inductor keeps in float32 values eager code rounds to bf16
    # (the same bound as the compiled model against the eager one, tests/test_model.py)
    assert_steps_close([torch.tensor(step) for step in got["logits"]], want_logits, rerounded_atol)
    assert_same_choices_but_near_ties(want_logits, want, got["tokens"], rerounded_atol)


@needs_packages
@pytest.mark.parametrize("lengths", [(1,), (9, 40, 3)])
def test_dynamic_token_and_request_counts(package, lengths):
    model = make_model()
    text = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate(lengths)]
    with torch.no_grad():
        want_prefill = model(**prefill_inputs(text, "cpu"), mode="prefill")
        # an extend step in decode mode: two more tokens per request
        more = step_inputs([[5, 6]] * len(text), list(lengths), "cpu")
        want_extend = model(**more, mode="decode")
    got_prefill = package(**prefill_inputs(text, "cpu"), mode="prefill")
    got_extend = package(**more, mode="decode")
    assert got_prefill.shape == (len(lengths), 256)
    assert_steps_close([got_prefill, got_extend], [want_prefill, want_extend], rerounded_atol)  # as above


@needs_packages
def test_empty_batch(package):
    empty = torch.empty(0, dtype=torch.long)
    out = package(empty, empty, empty, empty, empty, mode="decode")
    assert out.shape == (0, package.vocab_size) and out.dtype == torch.float32


def _good():
    return step_inputs([[1, 2, 3], [4]], [0, 0], "cpu")


@needs_packages
@pytest.mark.parametrize("change,match", [
    (dict(input_ids=torch.tensor([1, 2, 3, 4], dtype=torch.int32)), r"input_ids must be a 1-D int64 tensor on cpu, got int32 \[4\]"),
    (dict(positions=torch.zeros(4, 1, dtype=torch.long)), r"positions must be a 1-D int64 tensor on cpu, got int64 \[4, 1\]"),
    (dict(batch_index=torch.zeros(3, dtype=torch.long)), r"batch_index must have 4 entries \(input_ids' tokens\), got 3"),
    (dict(req_slots=torch.zeros(3, dtype=torch.long)), r"req_slots must have 2 entries \(seq_lens' requests\), got 3"),
    (dict(req_slots=torch.tensor([0, 4])), r"req_slots must be in \[0, 4\), got \[0, 4\]"),
    (dict(input_ids=torch.tensor([1, 2, 3, 256])), r"input_ids must be in \[0, 256\) \(the vocabulary\)"),
    (dict(seq_lens=torch.tensor([3, 513])), r"seq_lens must be in \[1, 512\]"),
    (dict(positions=torch.tensor([0, 1, -1, 0])), r"positions must be in \[0, seq_lens\[batch_index\]\)"),
    (dict(mode="extend"), r"mode must be one of \('prefill', 'decode'\), got 'extend'"),
])
def test_bad_inputs_name_the_argument_and_write_nothing(package, change, match):
    inputs = _good() | {"mode": "prefill"} | change
    before = {name: buf.clone() for name, buf in package.states.items()}
    with pytest.raises(ValueError, match=match):
        package(**inputs)
    for name, buf in package.states.items():
        assert torch.equal(buf, before[name]), name


@needs_packages
def test_token_and_request_counts_outside_the_package_range(package):
    many = step_inputs([[1] * (package.max_tokens // 2 + 1)] * 2, [0, 0], "cpu")
    with pytest.raises(ValueError, match=rf"input_ids must have 1..{package.max_tokens} tokens"):
        package(**many, mode="prefill")
    wide = step_inputs([[1]] * (package.max_requests + 1), [0] * (package.max_requests + 1), "cpu")
    with pytest.raises(ValueError, match=rf"seq_lens must have at most {package.max_requests} requests"):
        package(**wide, mode="prefill")


@needs_packages
def test_the_ops_errors_reach_through_the_package(package):
    """Past the loader's checks (the package called directly), a bad value that reaches an op
    gets that op's message: the package calls the ops through the dispatcher."""
    bad = _good() | {"positions": torch.tensor([-3, -2, -1, -1])}
    with pytest.raises(RuntimeError, match=r"dsv4.fused_k_norm_rope_flashmla: positions must be within \[0, \d+\)"):
        package.packages["prefill"](**bad)


@needs_packages
def test_a_forced_provider_steers_the_package(package):
    """Providers are resolved when the package runs: an override that cannot serve is an error."""
    refused = r"provider 'triton' forced for dsv4\.\w+ is not registered for cpu"
    with d4.use_provider("triton"), pytest.raises(RuntimeError, match=refused):
        package(**_good(), mode="prefill")


@needs_packages
def test_reset_zeroes_the_shared_states(package):
    package(**_good(), mode="prefill")  # the prefill package writes the loader's tensors
    assert any(buf.any() for buf in package.states.values())
    before = {name: buf.clone() for name, buf in package.states.items()}
    package(**step_inputs([[9], [9]], [3, 1], "cpu"), mode="decode")  # so does the decode package
    assert any(not torch.equal(buf, before[name]) for name, buf in package.states.items())
    package.reset()
    assert not any(buf.any() for buf in package.states.values())


@needs_packages
def test_loading_needs_both_packages(tmp_path):
    with pytest.raises(FileNotFoundError, match="prefill.pt2"):
        load_package(tmp_path)


@pytest.mark.skipif(packages_supported(), reason=f"torch >= {MIN_TORCH} runs packages")
def test_packages_refused_before(tmp_path):
    """Before torch 2.13 a package swallows the ops' exceptions: refused, with the reason."""
    with pytest.raises(RuntimeError, match=rf"need torch >= {MIN_TORCH} \(found .*logged and ignored"):
        build_package(make_model(), tmp_path)
    with pytest.raises(RuntimeError, match=rf"need torch >= {MIN_TORCH}"):
        load_package(tmp_path)


def test_export_names_what_is_too_small_for_its_trace():
    with pytest.raises(ValueError, match="max_tokens must be >= 8 to export a prefill step, got 6"):
        export_step(make_model(), "prefill", max_tokens=6)
    small = DeepseekV4Model(tiny_config(), CacheConfig(max_requests=1, max_seq_len=512), seed=0)
    with pytest.raises(ValueError, match="max_requests must be >= 2 to export a decode step, got 1"):
        export_step(small, "decode")
