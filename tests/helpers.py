"""Input builders shared by the tests."""

from __future__ import annotations

import math

import torch

import dsv4_compile as d4
from dsv4_compile import layout


def rope_table(max_pos: int, theta: float = 10000.0) -> torch.Tensor:
    """A real interleaved ``[max_pos, 64]`` (cos, sin) table."""
    inv = theta ** (-torch.arange(0, layout.ROPE_DIM, 2, dtype=torch.float64) / layout.ROPE_DIM)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.stack([ang.cos(), ang.sin()], -1).flatten(-2).float()


def store_inputs(num_tokens: int, dtype=torch.bfloat16, index_dtype=torch.int64, max_pos: int = 4096):
    kv = (torch.randn(num_tokens, layout.HEAD_DIM) * 3).to(dtype)
    weight = (1 + 0.5 * torch.randn(layout.HEAD_DIM)).to(dtype)
    freqs = rope_table(max_pos)
    positions = torch.randint(0, max_pos, (num_tokens,), dtype=index_dtype)
    return kv, weight, freqs, positions


def filled_cache(num_pages: int, page_size: int, num_tokens: int | None = None, page_stride=None):
    """A cache with ``num_tokens`` random tokens (default: every slot) stored by the op; returns
    ``(cache, slots)``."""
    cache = d4.alloc_cache(num_pages, page_size, page_stride=page_stride)
    cap = num_pages * page_size
    n = cap if num_tokens is None else num_tokens
    slots = torch.randperm(cap)[:n]
    kv, w, freqs, pos = store_inputs(n)
    d4.fused_k_norm_rope_flashmla(kv, w, freqs, pos, slots, cache, 1e-6, page_size)
    return cache, slots


def random_indices(shape, cap: int, hole_frac: float = 0.2) -> torch.Tensor:
    idx = torch.randint(0, cap, shape, dtype=torch.int32)
    return torch.where(torch.rand(shape) < hole_frac, torch.full_like(idx, -1), idx)


def sink(kind: str, heads: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "random":
        return torch.randn(heads)
    value = {"+inf": math.inf, "-inf": -math.inf}[kind]
    return torch.full((heads,), value)


def report(config, line: str) -> None:
    """Write ``line`` to the terminal past pytest's output capture."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    with config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        reporter.write("\n")
        reporter.write_line(line)


def run_interpreted_child(config, test_file: str, echo: tuple[str, ...] = ()) -> None:
    """Run ``test_file``'s CPU tests in a child pytest with ``TRITON_INTERPRET=1`` (Triton reads it
    when kernels are jitted, which this process may have done already). Fails unless the child
    passes and ran at least one test; echoes its summary and the lines starting with ``echo``."""
    import os
    import re
    import subprocess
    import sys

    import pytest

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process is interpreted already: the interpreted tests run here")
    test_file = os.path.abspath(test_file)
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
         "-k", "not test_interpreted_suite", test_file],
        cwd=os.path.dirname(os.path.dirname(test_file)), env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    passed = re.search(r"(\d+) passed", child.stdout)
    assert passed and int(passed[1]) > 0, "the interpreted child ran no test:\n" + child.stdout[-3000:]
    for line in child.stdout.splitlines():
        if line.startswith(echo) or passed[0] in line:
            report(config, f"TRITON_INTERPRET=1 child: {line}")
