"""al.audit over a corpus of user loops (tests/helpers/audit_loops.py): the exact verdict of each.

A correct loop is ok and quotes a float64-sized error; a buggy loop is never ok and gets
exactly its mistake names (and a finding outside the vocabulary only where one is
expected). Each loop is audited once per session.
"""

from __future__ import annotations

import pytest
from helpers import audit_loops as loops

from accumlab.loop_audit.controlled_set import AUDIT_TOLERANCE
from accumlab.loop_audit.report import NOT_CHECKED
from accumlab.mistakes import MISTAKES, reported_by

report_of = loops.report_of
flat = loops.flat
CASES = list(loops.EXPECTED.items())


def test_the_corpus_is_large_and_mixed():
    assert len(CASES) >= 30
    assert sum(e.ok for _, e in CASES) >= 10
    assert sum(not e.ok for _, e in CASES) >= 20
    named = set().union(*(e.mistakes for _, e in CASES))
    assert named == set(reported_by("loop"))  # every name has at least one loop


@pytest.mark.parametrize(("loop", "expected"), CASES, ids=[f.__name__ for f, _ in CASES])
def test_each_loop_gets_its_exact_verdict(loop, expected):
    report = report_of(loop)
    text = str(report)
    assert set(report.mistakes) == expected.mistakes, text
    assert bool(report.other) == expected.other, text
    assert report.ok == expected.ok, text
    assert text.startswith("audit: ok") == expected.ok
    if report.ok:
        # ok only when every applied update matches the rule within the stated tolerance
        assert all(w.update_error <= AUDIT_TOLERANCE for w in report.windows), text
        assert all(abs(x - 1) < 1e-9 for w in report.windows for x in w.weights), text
    # The printed report is wrapped at 100 characters a line (07 prints it); the quoted
    # texts are compared with their whitespace collapsed, each in full.
    assert max(len(line) for line in text.splitlines()) <= 100, text
    for name in report.mistakes:
        symptom, fix = MISTAKES[name].symptom, MISTAKES[name].fix
        assert f"\n- {name}\n" in text
        assert flat(f"evidence: {report.evidence[name]} symptom: {symptom} fix: {fix}") in flat(
            text
        )
    # every report says what it ran, then what it does not check
    assert flat(text).endswith(flat(f"{report.ran} {NOT_CHECKED}"))


def test_the_docs_count_the_corpus():
    """docs/AUDIT.md's loop-audit section says how many loops of each kind it holds."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "AUDIT.md").read_text(encoding="utf-8")
    right = sum(e.ok for _, e in CASES)
    wrong = len(CASES) - right
    assert f"holds {right} correct loops (0 false positives" in flat(doc)
    assert f"and {wrong} wrong ones" in flat(doc)
