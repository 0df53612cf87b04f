"""docs/AUDIT.md's matrix of jobs: every row names a test that exists (its file, its
function and, for a parametrized row, the case), and every job a matrix test runs has a row."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rows() -> list[tuple[str, str, str]]:
    text = (ROOT / "docs" / "AUDIT.md").read_text(encoding="utf-8")
    table = "\n".join(text.partition(heading)[2].partition("\n### ")[0]
                      for heading in ("### The jobs the tests run", "### The TRL trainers"))
    out = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("tests/"):
            out.append((cells[0], cells[1], cells[2]))
    return out


def test_every_row_names_a_test_that_exists():
    found = rows()
    assert len(found) >= 20
    for job, _verdict, test in found:
        path, _, rest = test.partition("::")
        name, _, case = rest.partition("[")
        source = (ROOT / path).read_text(encoding="utf-8")
        assert re.search(rf"^def {re.escape(name)}\(", source, re.MULTILINE), (job, test)
        if case:
            assert f'"{case.rstrip("]")}"' in source, (job, test)


def test_every_job_of_the_matrix_tests_has_a_row():
    named = {test for _, _, test in rows()}
    for path, function in (
        ("tests/hf/test_hf_jobs.py", "test_verdict_scale_and_fix_against_the_jobs_truth"),
        ("tests/hf/test_trl_trainers.py", "test_one_step_with_the_callback_trains_as_without_it_and_reports"),
    ):
        source = (ROOT / path).read_text(encoding="utf-8")
        verdicts = source.partition("VERDICTS = {")[2].partition("\n}")[0]
        cases = re.findall(r'"([^"]+)": (?:\[|")', verdicts)
        assert cases, path
        for case in cases:
            assert f"{path}::{function}[{case}]" in named, case
