"""The one table of mistakes every audit shares (accumlab.mistakes): every entry is
complete, and every name the loop audit emits is in it, marked as the loop audit's.

(The Trainer audit's names are checked against the same table in tests/hf, the
split-invariance engine's in tests/audit/test_invariance_engine.py.)
"""

from __future__ import annotations

import re

import pytest
from helpers import audit_loops as loops

from accumlab.mistakes import AUDITS, MISTAKES, Mistake, reported_by


@pytest.mark.parametrize("name", list(MISTAKES))
def test_every_mistake_has_a_cause_a_symptom_a_fix_and_its_audits(name):
    mistake = MISTAKES[name]
    assert isinstance(mistake, Mistake)
    assert re.fullmatch(r"[a-z]+(_[a-z0-9]+)+", name), "a name is a snake_case identifier"
    for field in ("cause", "symptom", "fix"):
        text = getattr(mistake, field)
        assert isinstance(text, str) and len(text.split()) >= 5, (field, text)
        assert text == " ".join(text.split()), f"{field} has stray whitespace"
    assert mistake.audits and mistake.audits <= set(AUDITS), mistake.audits


def test_each_audit_reports_names_in_the_table_order():
    for audit in AUDITS:
        names = reported_by(audit)
        assert names, audit
        assert list(names) == [n for n in MISTAKES if n in names]
        assert all(audit in MISTAKES[n].audits for n in names)
    assert set().union(*(reported_by(audit) for audit in AUDITS)) == set(MISTAKES)
    with pytest.raises(ValueError, match="audit must be one of"):
        reported_by("trainr")


def test_every_name_the_loop_audit_emits_is_a_loop_name_of_the_table():
    """Over the whole corpus of loops: each emitted name is in the table and marked for the
    loop audit, in the table's order, and each loop name of the table is emitted by some
    loop (so none is a name the audit cannot produce)."""
    emitted = set()
    for loop in loops.EXPECTED:
        report = loops.report_of(loop)
        assert report.mistakes == [n for n in MISTAKES if n in report.mistakes]
        for name in report.mistakes:
            assert "loop" in MISTAKES[name].audits, name
        emitted.update(report.mistakes)
    assert emitted == set(reported_by("loop"))


def test_the_split_factors_the_trainer_audit_recognises_have_their_names():
    """The Trainer audit's split check names a factor of 1/A ``double_division`` and a factor
    of A ``num_items_ignored``; both are in the table for it, beside ``depends_on_split``."""
    for name in ("double_division", "num_items_ignored", "depends_on_split"):
        assert "trainer" in MISTAKES[name].audits
