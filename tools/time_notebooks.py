"""Time a run-all of each notebook, without saving anything back to the notebook.

Each notebook is executed the way `tools/run_notebooks.py` and `pytest --nbval` run it (a
fresh kernel started with `--IPKernelApp.capture_fd_output=False`, Output widgets not
emulated, cells run in order from the notebook's own folder), but the executed copy stays
in memory, or goes to `--save-dir` if given: the committed notebook is never rewritten.

Two figures per run:

- wall: seconds from starting the kernel to its shutdown (`time.perf_counter`);
- CPU: user + system seconds of the kernel and of every process it started and reaped
  (the spawned ranks of notebook 04), from `resource.getrusage(RUSAGE_CHILDREN)` before
  and after, plus this process's own share (the client that feeds the kernel).

On a machine shared with other work, wall time grows with the load while CPU time barely
moves: read CPU as the work a notebook needs and wall as what a learner waited on that
machine at that moment.

`--no-processes` answers a workshop question instead: which cells still run on a laptop
that cannot start processes? It makes process creation raise `OSError` inside the kernel
(a first cell, added to the copy, replaces `multiprocessing`'s `Process.start` and
`subprocess.Popen`'s process creation), runs every cell even after an error, and lists the
cells that failed with the error each one raised.

Usage (the environment the Makefile uses for tests is set unless already set):

    .venv/bin/python tools/time_notebooks.py --repeat 2 notebooks/00_start_here.ipynb
    .venv/bin/python tools/time_notebooks.py --repeat 1 --no-processes notebooks/04_ddp_no_sync.ipynb
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import nbformat

# The kernel settings nbval uses live in one place: run_notebooks.nbval_client.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_notebooks import nbval_client  # noqa: E402

# The settings `make notebooks` and `make nbval` run under; the kernel inherits them.
RUN_ENV = {"TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}

# Run first in the kernel by --no-processes: every way the course starts a process (spawned
# ranks through multiprocessing, torchrun through subprocess) then raises OSError.
NO_PROCESSES_CELL = '''\
import multiprocessing.process as _mp_process
import subprocess as _subprocess


def _refuse(*args, **kwargs):
    raise OSError("this laptop cannot start processes (simulated by tools/time_notebooks.py)")


_mp_process.BaseProcess.start = _refuse
_subprocess.Popen._execute_child = _refuse
'''


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def run_notebook(
    path: Path, timeout: int = 900, no_processes: bool = False
) -> tuple[float, float, nbformat.NotebookNode]:
    """Execute the notebook at `path` once in a fresh kernel; the file is not written.

    Returns (wall seconds, CPU seconds, the executed notebook). CPU is user + system time
    of the kernel and its reaped descendants plus this process. A failing cell raises
    nbclient's CellExecutionError, unless `no_processes` is set: then process creation is
    refused inside the kernel, every cell runs even after an error, and the executed
    notebook has the refusing cell first (its other cells keep their order).
    """
    nb = nbformat.read(path, as_version=4)
    if no_processes:
        nb.cells.insert(0, nbformat.v4.new_code_cell(NO_PROCESSES_CELL))
    client = nbval_client(nb, path, timeout, allow_errors=no_processes)
    cpu_children = _cpu_seconds(resource.RUSAGE_CHILDREN)
    cpu_self = _cpu_seconds(resource.RUSAGE_SELF)
    start = time.perf_counter()
    client.execute()  # returns after the kernel has been shut down and reaped
    wall = time.perf_counter() - start
    cpu = (_cpu_seconds(resource.RUSAGE_CHILDREN) - cpu_children) + (
        _cpu_seconds(resource.RUSAGE_SELF) - cpu_self
    )
    return wall, cpu, nb


def _last_heading(markdown: str) -> str | None:
    """The last Markdown heading of a cell, ignoring `#` lines inside code fences."""
    heading, fenced = None, False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            heading = line.lstrip("# ").strip()
    return heading


def failed_cells(nb: nbformat.NotebookNode) -> list[tuple[int, str, str]]:
    """(cell index in the committed notebook, the section it is in, the error's name) for
    every code cell of a `no_processes` run that ended in an error."""
    failures, section = [], ""
    for index, cell in enumerate(nb.cells[1:]):  # cell 0 is NO_PROCESSES_CELL
        if cell.cell_type == "markdown":
            section = _last_heading(cell.source) or section
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            failures.append((index, section, errors[0].get("ename", "?")))
    return failures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/[0-9]*.ipynb")
    parser.add_argument("--repeat", type=int, default=2, help="runs per notebook (default 2)")
    parser.add_argument("--save-dir", type=Path, default=None, help="write executed copies here")
    parser.add_argument(
        "--no-processes", action="store_true", help="refuse process creation; list the cells that fail"
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    paths = args.notebooks or sorted(Path("notebooks").glob("[0-9]*.ipynb"))
    if args.save_dir is not None:
        args.save_dir.mkdir(parents=True, exist_ok=True)
        if any(args.save_dir.resolve() == p.parent.resolve() for p in paths):
            parser.error("--save-dir must not be the notebooks' own folder: the copies would replace them")
    for key, value in RUN_ENV.items():
        os.environ.setdefault(key, value)
    print(" ".join(f"{k}={os.environ[k]}" for k in RUN_ENV), f"cpus={os.cpu_count()}", flush=True)
    for path in paths:
        for run in range(1, args.repeat + 1):
            load = os.getloadavg()[0]
            wall, cpu, nb = run_notebook(path, no_processes=args.no_processes)
            print(
                f"{path.name}  run {run}: wall {wall:6.1f} s  cpu {cpu:6.1f} s  "
                f"(1-min load average before: {load:.1f})",
                flush=True,
            )
            if args.save_dir is not None:
                nbformat.write(nb, args.save_dir / path.name)
        if args.no_processes:
            failures = failed_cells(nb)
            print(f"  {len(failures)} cell(s) failed without processes:")
            for index, section, name in failures:
                print(f"    cell {index:3d}  {name:<18} in {section}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
