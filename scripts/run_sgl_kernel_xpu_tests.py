"""Run sgl-kernel-xpu's own DSV4 kernel tests against ``dsv4_compile.compat.sgl_kernel``.

Usage::

    python scripts/run_sgl_kernel_xpu_tests.py --repo /path/to/sgl-kernel-xpu [--device cpu] [--quick] [-- PYTEST_ARGS]

``--repo`` is a checkout of https://github.com/sgl-project/sgl-kernel-xpu (only its ``tests/``
directory is read). The runner copies the test files below, and the helper modules of that
``tests/`` directory they import, into a temporary directory (never into this repository),
rewrites them for ``--device`` (the rules in ``rewrites()``), shadows ``sgl_kernel`` there with a
package re-exporting ``dsv4_compile.compat.sgl_kernel``, runs pytest once per file in a
subprocess, and prints per-file counts and, for each failure, its test id and the first line of
its error. Names the tests use from ``sgl_kernel`` that the compat module lacks are reported, not
faked: the tests that call them are deselected (``TEST_FILES``' ``-k`` expressions).

``--quick`` deselects the parametrizations that are slow on the CPU reference (``QUICK``).
Arguments after ``--`` go to every pytest run (e.g. ``-- -x -k variable``; a ``-k`` there is
and-ed with the runner's own). Exit status: 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # this repository (for ``import dsv4_compile``)

# test file -> pytest -k expression selecting the tests of kernels we provide (None: all)
TEST_FILES = {
    "test_flash_mla_with_kvcache.py": None,
    "test_flash_mla_sparse_fwd.py": None,
    "test_fused_qk_norm_rope.py": "fused_k_norm_rope_flashmla",
}
# --quick: -k expressions (per file) dropping the parametrizations slow on the CPU reference
# (the decode tests at bs 384 / 512 take ~25 of a full CPU run's ~30 minutes; the rest ~1 minute)
QUICK = {"test_flash_mla_with_kvcache.py": "not 384 and not 64-512-dtype0"}  # drop bs 384 and 512
# sgl_kernel names re-exported from dsv4_compile.compat.sgl_kernel
PROVIDED = ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "fused_k_norm_rope_flashmla")


def rewrites(device: str) -> list[tuple[str, str]]:
    """``(regex, replacement)`` rules applied, in order, to every copied file."""
    cpu = device == "cpu"
    return [
        (r"torch\.xpu\.is_available\(\)", "True" if cpu else "torch.cuda.is_available()"),
        (r"torch\.xpu\.synchronize\(\)", "torch.cpu.synchronize()" if cpu else "torch.cuda.synchronize()"),
        (r"torch\.xpu\.empty_cache\(\)", "None" if cpu else "torch.cuda.empty_cache()"),
        (r"torch\.xpu\.manual_seed(_all)?\(", "torch.manual_seed("),
        (r"""(["'])xpu\1""", f'"{device}"'),  # device strings: torch.device("xpu"), device = "xpu"
        (r"utils\.get_device\(\)", f'torch.device("{device}")'),  # utils.py prefers cuda, then xpu
    ]


def local_imports(path: Path, tests_dir: Path) -> set[str]:
    """Top-level modules ``path`` imports that are files of ``tests_dir``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return {n for n in names if (tests_dir / f"{n}.py").is_file()}


def sgl_kernel_names(path: Path) -> tuple[set[str], set[str]]:
    """Names ``path`` takes from ``sgl_kernel``: ``from sgl_kernel import X`` and ``sgl_kernel.X``."""
    imported, used = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "sgl_kernel":
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "sgl_kernel":
            used.add(node.attr)
    return imported, used


def prepare(repo: Path, tmp: Path, device: str) -> dict[str, tuple[set[str], set[str]]]:
    """Copy and rewrite the tests and their helpers into ``tmp``, write the ``sgl_kernel`` shim;
    returns the missing ``sgl_kernel`` names per test file: (from-imported, used as attributes)."""
    tests_dir = repo / "tests"
    todo = [*TEST_FILES, "conftest.py"]
    copied: set[str] = set()
    while todo:
        name = todo.pop()
        if name in copied or not (tests_dir / name).is_file():
            if name not in copied and name != "conftest.py":
                raise SystemExit(f"{tests_dir / name} not found: is --repo a sgl-kernel-xpu checkout?")
            continue
        copied.add(name)
        text = (tests_dir / name).read_text()
        for pattern, repl in rewrites(device):
            text = re.sub(pattern, repl, text)
        if "torch.xpu" in text:
            print(f"warning: {name} still uses torch.xpu after the rewrite", file=sys.stderr)
        (tmp / name).write_text(text)
        todo += [f"{m}.py" for m in local_imports(tests_dir / name, tests_dir)]
    shim = tmp / "sgl_kernel"
    shim.mkdir()
    (shim / "__init__.py").write_text(
        '"""sgl-kernel-xpu\'s names, from dsv4_compile (written by run_sgl_kernel_xpu_tests.py)."""\n'
        f"from dsv4_compile.compat.sgl_kernel import {', '.join(PROVIDED)}\n"
    )
    return {f: tuple(names - set(PROVIDED) for names in sgl_kernel_names(tmp / f)) for f in TEST_FILES}


def first_line(bad: ET.Element) -> str:
    """The first line of a JUnit failure/error: its message, or (collection errors) the first
    ``E`` line of its traceback."""
    text = bad.get("message") or ""
    if text in ("", "collection failure"):
        text = next((ln[1:] for ln in (bad.text or "").splitlines() if ln.startswith("E ")), text or bad.text or "?")
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "?")[:200]


def run_file(tmp: Path, name: str, device: str, quick: bool, extra: list[str]) -> dict:
    """Run pytest on one copied file; its counts and failures from the JUnit XML and the
    deselected count from the terminal summary."""
    ks = [k for k in (TEST_FILES[name], QUICK.get(name) if quick else None) if k]
    if "-k" in extra:  # and the caller's -k with ours
        i = extra.index("-k")
        ks.append(extra[i + 1])
        extra = extra[:i] + extra[i + 2:]
    xml = tmp / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", name, "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp),
           f"--junitxml={xml}", "-o", "junit_family=xunit1", "--tb=short", *extra]
    if ks:
        cmd += ["-k", " and ".join(f"({k})" for k in ks)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # keep the dsv4 ops on their CPU path
    print(f"\n=== {name}: {' '.join(cmd[3:])}", flush=True)
    out = []
    with subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        while chunk := os.read(proc.stdout.fileno(), 4096):  # streamed as it comes: progress dots too
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
            out.append(chunk)
    lines = b"".join(out).decode(errors="replace").splitlines()
    (tmp / f"{name}.log").write_text("\n".join(lines))  # kept with --keep
    tail = [ln for ln in lines if ln][-1:] or [""]
    res = {"passed": 0, "failed": 0, "skipped": 0, "deselected": 0, "failures": [], "rc": proc.returncode}
    m = re.search(r"(\d+) deselected", tail[0])
    res["deselected"] = int(m.group(1)) if m else 0
    if not xml.is_file():
        res["failures"].append((name, f"pytest exited {proc.returncode} without a report:\n"
                                + "\n".join(lines[-20:])))
        return res
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls = case.get("classname", "").split(".")[1:]  # [module, Class...]: keep the classes
        tid = "::".join([name, *cls, case.get("name")]) if case.get("classname") else f"{name} (collection)"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            res["failed"] += 1
            res["failures"].append((tid, first_line(bad)))
        elif case.find("skipped") is not None:
            res["skipped"] += 1
        else:
            res["passed"] += 1
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, required=True, help="a checkout of sgl-kernel-xpu")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="skip the parametrizations slow on CPU (QUICK)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: extra pytest arguments")
    a = p.parse_args()
    extra = a.pytest_args[1:] if a.pytest_args[:1] == ["--"] else a.pytest_args
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")

    tmp = Path(tempfile.mkdtemp(prefix="sgl_kernel_xpu_tests_"))
    try:
        missing = prepare(a.repo.resolve(), tmp, a.device)
        print(f"device {a.device}; tests copied to {tmp}")
        for name, (imported, used) in missing.items():
            if used - imported:  # called as sgl_kernel.X: TEST_FILES' -k must deselect their tests
                print(f"{name}: sgl_kernel names not provided (their tests deselected): {', '.join(sorted(used - imported))}")
            if imported:  # from sgl_kernel import X: the module cannot be collected at all
                print(f"{name}: sgl_kernel names not provided, imported at module level: {', '.join(sorted(imported))}")
        results = {name: run_file(tmp, name, a.device, a.quick, extra) for name in TEST_FILES}
    finally:
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print("\n=== summary")
    print(f"{'file':34} {'passed':>7} {'failed':>7} {'skipped':>8} {'deselected':>11}")
    for name, r in results.items():
        print(f"{name:34} {r['passed']:7} {r['failed']:7} {r['skipped']:8} {r['deselected']:11}")
    failures = [f for r in results.values() for f in r["failures"]]
    for tid, msg in failures:
        print(f"FAILED {tid}: {msg}")
    return 1 if failures or any(r["rc"] not in (0, 5) for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
