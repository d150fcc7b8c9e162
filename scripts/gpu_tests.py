"""The GPU test suite (``pytest -m cuda``) in shards that each fit one device command.

    python scripts/gpu_tests.py --list             # each shard and its test files, one per line
    python scripts/gpu_tests.py --shard N [-- ARGS]  # run shard N (1-based): pytest's exit code

Every test file with CUDA-marked tests is in exactly one shard (``tests/test_gpu_shards.py`` checks
it on CPU, so a new file cannot be left out). The shards are balanced by their measured times on an
H100 (benchmarks/RESULTS.md, "GPU test suite"): each within 6 minutes, all within 15 one after
another. ``ARGS`` go to pytest as they are (e.g. ``--durations=20``). Run all of them on a GPU
machine with::

    for n in $(python scripts/gpu_tests.py --count); do python scripts/gpu_tests.py --shard $n || break; done

or at once, each a process of its own (one H100 and 16 CPU cores: about 6 minutes for all four)::

    for n in $(python scripts/gpu_tests.py --count); do python scripts/gpu_tests.py --shard $n > shard$n.log & done; wait
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the shards' test files (paths relative to the repository root)
SHARDS: list[list[str]] = [
    ["tests/test_cuda.py", "tests/test_triton_attention.py", "tests/test_flashmla_schedule.py"],
    ["tests/test_block.py", "tests/test_block_reference.py", "tests/test_compat.py"],
    ["tests/test_model.py"],  # a whole model compiled per test (reduce-overhead): ~30 s each
    [
        "tests/test_triton_store.py",
        "tests/test_indexer_cache.py",
        "tests/test_indexer_cache_topk.py",
        "tests/test_indexer_logits.py",
        "tests/test_indexer_topk.py",
        "tests/test_rope.py",
        "tests/test_batch_invariance.py",
        "tests/test_tp.py",
        "tests/test_step_limits.py",
    ],
]


def cuda_test_files() -> set[str]:
    """The test files that hold CUDA-marked tests, as pytest collects them (on any machine: CUDA
    tests are collected and skipped where there is no GPU)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    if out.returncode not in (0, 5):
        raise RuntimeError(f"collecting the CUDA tests failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    return {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}


def run_shard(number: int, pytest_args: list[str]) -> int:
    if not 1 <= number <= len(SHARDS):
        raise SystemExit(f"--shard must be in 1..{len(SHARDS)}, got {number}")
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", *SHARDS[number - 1], *pytest_args]
    print(f"shard {number}/{len(SHARDS)}:", " ".join(command[1:]), flush=True)
    return subprocess.run(command, cwd=ROOT, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv, pytest_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="print each shard and its test files")
    what.add_argument("--count", action="store_true", help="print the shard numbers, one per line")
    what.add_argument("--shard", type=int, metavar="N", help="run shard N (1-based); exit with pytest's code")
    args = parser.parse_args(argv)
    if args.list:
        for number, files in enumerate(SHARDS, start=1):
            print(f"shard {number}")
            print("\n".join(files))
        return 0
    if args.count:
        print("\n".join(str(n) for n in range(1, len(SHARDS) + 1)))
        return 0
    return run_shard(args.shard, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
