"""Two versions of the package, the same step benchmark, in alternating processes.

    python scripts/ab_step.py BASE NEW [--rounds 2] [--out DIR] [--new-args "..."] -- <bench_step.py arguments>

``BASE`` and ``NEW`` are directories that each hold a ``dsv4_compile`` package (e.g. ``.`` and
a ``git archive REV dsv4_compile | tar -x -C base`` of another revision); they may be the same
directory, with ``--new-args`` (bench_step.py arguments added to NEW's runs only, e.g.
``--new-args "--inductor max_autotune_gemm=True"``) as the difference.

Each run is a fresh process of ``benchmarks/bench_step.py`` (both versions must serve its
imports), with the version first on ``PYTHONPATH`` (checked: the process imports that version).
Each version runs ``--rounds`` times, in the order BASE NEW NEW BASE BASE NEW ..., so a drift
across the runs, or anything a second process finds warmer than the first, weighs on both alike.

Reported per batch size and mode: each version's median step time over its runs, every run's
time, and NEW / BASE. Each run's JSON report goes to ``--out`` (``<version>_<run>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def order(rounds: int) -> list[str]:
    """``rounds`` runs of each version, ABBA-ordered: base, new, new, base, base, new, ..."""
    return ["new" if i % 4 in (1, 2) else "base" for i in range(2 * rounds)]


def environment(root: Path) -> dict:
    """The environment of a process that imports the ``dsv4_compile`` under ``root``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root.resolve()), *filter(None, [env.get("PYTHONPATH")])])
    found = subprocess.run([sys.executable, "-c", "import dsv4_compile; print(dsv4_compile.__file__)"],
                           env=env, cwd=BENCHMARKS, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"with {root} first on PYTHONPATH the process imports {found}: an install shadows it")
    return env


def run_once(env: dict, bench_args: list[str], json_path: Path) -> dict:
    command = [sys.executable, str(BENCHMARKS / "bench_step.py"), *bench_args, "--json", str(json_path)]
    child = subprocess.run(command, env=env, capture_output=True, text=True)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({env['PYTHONPATH']}):\n{child.stderr[-4000:]}")
    return json.loads(json_path.read_text())


def step_times(report: dict) -> dict[tuple[str, str], float]:
    """``{(batch, mode): ms}`` of a bench_step report."""
    return {
        (batch, key[: -len("_ms")]): value
        for batch, row in report["decode"].items()
        for key, value in row.items() if key.endswith("_ms") and key != "roofline_ms"
    }


def compare(reports: dict[str, list[dict]]) -> list[dict]:
    rows = []
    times = {name: [step_times(r) for r in runs] for name, runs in reports.items()}
    for key in sorted(times["base"][0], key=lambda k: (int(k[0]), k[1])):
        base = [t[key] for t in times["base"] if key in t]
        new = [t[key] for t in times["new"] if key in t]
        row = {"batch": key[0], "mode": key[1], "base_ms": statistics.median(base), "new_ms": statistics.median(new),
               "base_runs": base, "new_runs": new}
        row["new_over_base"] = round(row["new_ms"] / row["base_ms"], 3)
        rows.append(row)
    return rows


def main() -> list[dict]:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each version (ABBA order)")
    parser.add_argument("--out", type=Path, default=Path("ab_step"), help="where each run's JSON report goes")
    parser.add_argument("--new-args", default="", help="bench_step.py arguments for NEW's runs only")
    args = parser.parse_args(argv[:split])
    bench_args = {"base": argv[split + 1:], "new": [*argv[split + 1:], *shlex.split(args.new_args)]}
    for name in ("base", "new"):
        if not (getattr(args, name) / "dsv4_compile" / "__init__.py").is_file():
            parser.error(f"{name}: {getattr(args, name)} holds no dsv4_compile package")
    args.out.mkdir(parents=True, exist_ok=True)
    envs = {name: environment(getattr(args, name)) for name in ("base", "new")}
    reports = {"base": [], "new": []}
    for i, name in enumerate(order(args.rounds)):
        reports[name].append(run_once(envs[name], bench_args[name], args.out / f"{name}_{i}.json"))
        print(f"run {i}: {name} done", flush=True)
    rows = compare(reports)
    for row in rows:
        print(f"b={row['batch']:>3} {row['mode']:16s} base {row['base_ms']:.3f} ms  new {row['new_ms']:.3f} ms  "
              f"new/base {row['new_over_base']:.3f}  runs {row['base_runs']} / {row['new_runs']}")
    (args.out / "comparison.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
