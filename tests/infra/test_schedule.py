"""make test's schedule and log (tests/conftest.py): the longest files first, each file whole,
and a summary of where the time went."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest  # tests/conftest.py, the module pytest loaded

ROOT = Path(__file__).resolve().parents[2]


def test_longest_first_names_each_file_once_and_every_file_exists():
    assert len(set(conftest.LONGEST_FIRST)) == len(conftest.LONGEST_FIRST)
    missing = [f for f in conftest.LONGEST_FIRST if not (ROOT / f).is_file()]
    assert missing == [], "renamed or removed: update LONGEST_FIRST in tests/conftest.py"
    assert any(f.startswith("notebooks/") for f in conftest.LONGEST_FIRST)


def test_the_longest_files_come_first_and_each_file_keeps_its_tests_together_in_order():
    first, second = conftest.LONGEST_FIRST[:2]
    ids = [
        "tests/a/test_x.py::test_1",
        "tests/a/test_x.py::test_2[p]",
        f"{second}::test_b1",
        f"{second}::test_b2",
        "tests/a/test_y.py::test_1",
        f"{first}::Cell 0",
        f"{first}::Cell 1",
    ]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    conftest.pytest_collection_modifyitems(config=None, items=items)
    assert [i.nodeid for i in items] == [
        f"{first}::Cell 0",
        f"{first}::Cell 1",
        f"{second}::test_b1",
        f"{second}::test_b2",
        "tests/a/test_x.py::test_1",  # the others after, in pytest's order
        "tests/a/test_x.py::test_2[p]",
        "tests/a/test_y.py::test_1",
    ]


def test_the_summary_says_where_the_time_went():
    log = conftest.TimeLog()
    for nodeid, worker, seconds in [
        ("tests/a/test_x.py::test_1", "gw0", 2.0),
        ("tests/a/test_x.py::test_1", "gw0", 1.0),  # its teardown
        ("tests/a/test_y.py::test_1", "gw1", 4.25),
        ("tests/b/test_z.py::test_1", "gw1", 0.4),
        ("notebooks/04_x.ipynb::Cell 3", "gw0", 9.0),
    ]:
        log.add(nodeid, worker, seconds)
    assert log.summary(files=2) == [
        "17 s of tests in all; per worker: gw0 12 s, gw1 5 s",
        "per directory: notebooks 9 s, tests/a 7 s, tests/b 0 s",
        "slowest files: notebooks/04_x.ipynb 9 s, tests/a/test_y.py 4 s",
    ]
