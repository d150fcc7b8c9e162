"""``scripts/gpu_tests.py``: the GPU suite's shards cover every file with CUDA-marked tests once."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_tests.py"


def load_runner():
    spec = importlib.util.spec_from_file_location("gpu_tests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_file_with_cuda_tests_is_in_exactly_one_shard():
    runner = load_runner()
    sharded = Counter(f for shard in runner.SHARDS for f in shard)
    assert [f for f, n in sharded.items() if n > 1] == []
    cuda_files = runner.cuda_test_files()
    assert "tests/test_cuda.py" in cuda_files  # the collection found CUDA tests at all
    assert sorted(cuda_files - set(sharded)) == [], "CUDA test files in no shard of scripts/gpu_tests.py"
    assert sorted(set(sharded) - cuda_files) == [], "shard files without CUDA tests (renamed or moved?)"


def test_list_prints_each_shard_then_its_files_one_per_line():
    runner = load_runner()
    out = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, check=True)
    want = [line for n, files in enumerate(runner.SHARDS, 1) for line in (f"shard {n}", *files)]
    assert out.stdout.splitlines() == want
    count = subprocess.run([sys.executable, str(SCRIPT), "--count"], capture_output=True, text=True, check=True)
    assert count.stdout.split() == [str(n) for n in range(1, len(runner.SHARDS) + 1)]


def test_a_shard_number_out_of_range_is_an_error_naming_the_range():
    runner = load_runner()
    out = subprocess.run([sys.executable, str(SCRIPT), "--shard", str(len(runner.SHARDS) + 1)],
                         capture_output=True, text=True, check=False)
    assert out.returncode != 0
    assert f"--shard must be in 1..{len(runner.SHARDS)}, got {len(runner.SHARDS) + 1}" in out.stderr


def test_a_shard_runs_its_files_cuda_tests_and_returns_pytests_exit_code():
    """On a machine without a GPU the shard's CUDA tests are collected and skipped: exit code 0."""
    runner = load_runner()
    shard = min(range(len(runner.SHARDS)), key=lambda i: len(runner.SHARDS[i])) + 1
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--shard", str(shard), "--", "--collect-only", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    collected = {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}
    assert collected == set(runner.SHARDS[shard - 1])
