"""Fixtures shared by every test folder; the helpers tests import live in ``helpers/``.

pytest puts this folder on ``sys.path`` (it has no ``__init__.py``), so tests and spawned
ranks import ``helpers.<module>``.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.models import CausalToy, small_gpt
from hypothesis import settings

from accumlab_course.models import TinyGPT

# CI runs the property tests with a fixed seed: a red build must be reproducible, and
# exploring fresh random cases is for local runs.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

torch.set_num_threads(1)


@pytest.fixture
def toy64() -> CausalToy:
    """A float64 :class:`CausalToy` with fixed weights."""
    torch.manual_seed(0)
    return CausalToy().double()


@pytest.fixture
def gpt64() -> TinyGPT:
    """A float64 one-layer TinyGPT with fixed weights."""
    return small_gpt(torch.float64)


@pytest.fixture(autouse=True)
def _exercise_messages_on_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkers print their verdicts and hints wrapped at 88 characters for the notebooks;
    tests read them on one line, so a phrase they look for is never cut by a line break.
    ``tests/course/test_exercise_messages.py`` checks the wrapping itself."""
    import accumlab_course.exercises as exercises

    monkeypatch.setattr(exercises, "WIDTH", None)


# ------------------------------------------------------------ make test's schedule and log

#: The test files and notebooks that take longest, longest first (by the seconds each took
#: on its worker in make test and make slow on a quiet 2-core machine). ``make test`` hands
#: whole files to its workers (pytest-xdist, ``--dist loadfile --no-loadscope-reorder``) in
#: collection order, each worker taking the next file when it runs low; starting the long
#: ones first keeps every worker busy to the end, instead of one finishing a long file it
#: took last while the other waits. Files not named here follow in pytest's order. A stale
#: order costs only balance; the log's "where the time went" shows the slowest files
#: (tests/infra/test_schedule.py checks that each entry names a file that exists).
LONGEST_FIRST = (
    # the slow tier's (make slow); their other tests, in make test, take a few seconds
    "tests/infra/test_site.py",
    "tests/infra/test_install_cell.py",
    "tests/hf/test_hf_audit_versions.py",
    "tests/hf/test_trl_trainers.py",
    "tests/infra/test_wheel.py",
    "tests/infra/test_nbval_matrix.py",
    "tests/hf/test_hf_audit_ranks.py",
    "tests/notebooks/test_hf_requirements.py",
    # make test's
    "tests/course/test_exercises_03_04.py",  # a 20 s process-group timeout inside
    "notebooks/04_ddp_no_sync.ipynb",
    "tests/cli/test_cli_trust.py",
    "tests/distributed/test_distributed.py",
    "tests/hf/test_hf_callback.py",
    "tests/distributed/test_rank_decisions.py",
    "tests/core/test_chunked_loss.py",
    "notebooks/05_memory_instrumentation.ipynb",
    "notebooks/07_capstone.ipynb",
    "tests/checkpoint/test_checkpoint_lock.py",
    "notebooks/02_token_weighting.ipynb",
    "notebooks/01_single_device_loop.ipynb",
    "notebooks/06_when_equivalence_ends.ipynb",
    "tests/hf/test_hf_audit.py",
    "tests/driver/test_memory.py",
    "notebooks/03_amp_gradscaler.ipynb",
    "tests/hf/test_hf_jobs.py",
    "notebooks/08_audit_your_job.ipynb",
)


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the files of :data:`LONGEST_FIRST` first, in its order; a stable sort, so each
    file's tests keep their order and stay together (module fixtures are made once)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_file(item.nodeid), len(rank)))


class TimeLog:
    """Seconds spent per test file or notebook (the setup, call and teardown of each of its
    tests, as measured where they ran) and per worker, for the summary at the end of a run."""

    def __init__(self) -> None:
        self.per_file: dict[str, float] = {}
        self.per_worker: dict[str, float] = {}

    def add(self, nodeid: str, worker: str, seconds: float) -> None:
        file = _file(nodeid)
        self.per_file[file] = self.per_file.get(file, 0.0) + seconds
        self.per_worker[worker] = self.per_worker.get(worker, 0.0) + seconds

    def summary(self, files: int = 15) -> list[str]:
        """Where the time went: seconds per worker (how even the split was), per directory,
        and the ``files`` slowest files and notebooks, each list slowest first."""
        total = sum(self.per_file.values())
        per_dir: dict[str, float] = {}
        for file, seconds in self.per_file.items():
            folder = file.rsplit("/", 1)[0] if "/" in file else "."
            per_dir[folder] = per_dir.get(folder, 0.0) + seconds

        def listed(seconds: dict[str, float], limit: int | None = None) -> str:
            ranked = sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
            return ", ".join(f"{name} {s:.0f} s" for name, s in ranked)

        return [
            f"{total:.0f} s of tests in all; per worker: {listed(self.per_worker)}",
            f"per directory: {listed(per_dir)}",
            f"slowest files: {listed(self.per_file, files)}",
        ]


_TIME_LOG = TimeLog()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    node = getattr(report, "node", None)  # the pytest-xdist worker that ran it (controller)
    _TIME_LOG.add(report.nodeid, node.gateway.id if node is not None else "main", report.duration)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The run's time per worker, per directory and for the slowest files (``--durations``
    lists the slowest single tests); only where the results are gathered, not in workers."""
    if not _TIME_LOG.per_file or hasattr(config, "workerinput"):
        return
    terminalreporter.section("where the time went", sep="=")
    for line in _TIME_LOG.summary():
        terminalreporter.write_line(line)
