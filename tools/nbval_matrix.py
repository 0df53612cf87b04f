"""Strict nbval under several CPU kernel choices: which cells depend on the machine?

A saved output must reproduce on any learner's CPU, not only on the one that saved it.
PyTorch picks its CPU kernels at run time: ``ATEN_CPU_CAPABILITY`` caps ATen's vectorized
kernels (``default`` is the portable scalar build, unset is the machine's best),
``ONEDNN_MAX_CPU_ISA`` caps oneDNN's (``SSE41`` is the oldest; unset is the best, AMX or
AVX-512 where present), and the thread count changes how reductions are split. Each choice
can move the last bits of a float, and a number that is printed near a rounding boundary,
or a bf16 trajectory, then prints differently.

This runs strict ``pytest --nbval`` on the given notebooks once per choice and lists every
cell that failed under some choices and passed under others (depends on the machine), or
failed under all (broken or stale output):

    python tools/nbval_matrix.py notebooks/*.ipynb               # 4 runs that cover every pair
    python tools/nbval_matrix.py --matrix full notebooks/07_*.ipynb   # all 8 combinations

``pairs`` (the default) is an orthogonal array: every level of every factor meets every
level of every other factor in some run, so a cell that depends on one factor, or on two
together, fails in at least one run. Exit status 1 when any cell failed anywhere.
Run it before committing re-executed notebooks (CONTRIBUTING.md).
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each factor: (environment variable, its two levels; None leaves the variable unset).
FACTORS: list[tuple[str, tuple[str | None, str | None]]] = [
    ("ATEN_CPU_CAPABILITY", (None, "default")),
    ("ONEDNN_MAX_CPU_ISA", (None, "SSE41")),
    ("OMP_NUM_THREADS", ("1", "2")),
]
# Rows of the L4 orthogonal array: levels of the three factors in each of four runs.
PAIRS = [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)]


@dataclass
class Config:
    """One run's environment: the variables it sets and the ones it removes."""

    settings: dict[str, str | None]

    @property
    def name(self) -> str:
        shown = [f"{k}={'best' if v is None else v}" for k, v in self.settings.items()]
        return " ".join(shown)

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        for key, value in self.settings.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env


def configs(matrix: str) -> list[Config]:
    """The runs of ``matrix`` (``pairs`` or ``full``), the machine's defaults first."""
    if matrix == "pairs":
        rows = PAIRS
    elif matrix == "full":
        rows = list(itertools.product((0, 1), repeat=len(FACTORS)))
    else:
        raise ValueError(f"matrix must be 'pairs' or 'full', got {matrix!r}")
    return [Config({name: levels[i] for (name, levels), i in zip(FACTORS, row, strict=True)})
            for row in rows]


@dataclass
class RunResult:
    config: Config
    seconds: float
    cells: dict[str, str] = field(default_factory=dict)  # "notebook::Cell N" -> "passed" | message
    capability: str = "?"
    error: str = ""


def parse_junit(path: Path) -> dict[str, str]:
    """Each test case of a pytest JUnit XML file: id -> ``"passed"`` or its first failure line."""
    cells: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        where = case.get("file") or case.get("classname") or ""
        key = f"{Path(where).name if where.endswith('.ipynb') else where}::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            text = (failure.get("message") or failure.text or "failed").strip()
            cells[key] = text.splitlines()[0][:200] if text else "failed"
        elif case.find("skipped") is None:
            cells[key] = "passed"
    return cells


def cpu_capability(env: dict[str, str], python: str) -> str:
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    return done.stdout.strip() or "?"


def run(config: Config, notebooks: list[str], python: str, workdir: Path) -> RunResult:
    env = config.environment(os.environ.copy())
    env.setdefault("TQDM_DISABLE", "1")
    env.setdefault("MPLBACKEND", "Agg")
    env.setdefault("PYTHONHASHSEED", "0")
    report = workdir / f"{abs(hash(config.name))}.xml"
    start = time.monotonic()
    done = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
         f"--junitxml={report}", "-o", "junit_family=xunit1", *notebooks],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )
    result = RunResult(config, time.monotonic() - start, capability=cpu_capability(env, python))
    if report.exists():
        result.cells = parse_junit(report)
    if not result.cells:
        lines = (done.stdout + done.stderr).strip().splitlines()
        result.error = lines[-1] if lines else "no result"
    return result


def summarize(results: list[RunResult]) -> tuple[list[str], int]:
    """The report's lines and the number of cells that failed under any run."""
    lines = ["runs:"]
    for r in results:
        failed = sum(v != "passed" for v in r.cells.values())
        status = r.error or f"{len(r.cells) - failed} passed, {failed} failed"
        lines.append(f"  {r.config.name:68} cpu={r.capability:8} {status} ({r.seconds:.0f} s)")
    keys = sorted({k for r in results for k in r.cells})
    bad = [k for k in keys if any(r.cells.get(k, "passed") != "passed" for r in results)]
    if not bad:
        lines.append(f"every cell ({len(keys)}) passed under every run: no output depends on "
                     "these kernel choices")
        return lines, 0
    lines.append(f"{len(bad)} cell(s) failed under some run:")
    for key in bad:
        failing = [r for r in results if r.cells.get(key, "passed") != "passed"]
        kind = ("fails everywhere (broken or stale output)" if len(failing) == len(results)
                else "depends on the machine")
        lines.append(f"  {key}: {kind}")
        for r in failing:
            lines.append(f"    under {r.config.name}: {r.cells[key]}")
    return lines, len(bad)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", help="notebooks to run under every choice")
    parser.add_argument("--matrix", choices=("pairs", "full"), default="pairs")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with nbval")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    runs = configs(args.matrix)
    print(f"strict nbval on {len(args.notebooks)} notebook(s) under {len(runs)} kernel "
          f"choices, {args.jobs} at a time ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda c: run(c, args.notebooks, args.python, Path(tmp)), runs))
    lines, bad = summarize(results)
    print("\n".join(lines))
    return 1 if bad or any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
