"""``accumlab_course.ranks.Ranks``: processes started once that run one worker after another,
as notebook 04 uses them (its run-all under nbval exercises the happy path too)."""

from __future__ import annotations

import os

import pytest

from accumlab_course import workers
from accumlab_course.ranks import Ranks


def test_a_worker_the_ranks_cannot_import_is_refused_before_any_process_starts():
    ranks = Ranks(2)
    with pytest.raises(ValueError, match="importable module"):
        ranks.run(lambda: 1)
    with pytest.raises(TypeError, match="must be a function"):
        ranks.run(3)
    assert not ranks.running and ranks.starts == 0
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        Ranks(0)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_same_processes_serve_every_call_until_an_error_ends_the_group():
    with Ranks(2, timeout_s=10) as ranks:
        first = ranks.run(os.getpid)
        views = ranks.run(workers.whoami)
        assert ranks.run(os.getpid) == first  # the same two processes, in rank order
        assert [v["rank"] for v in views] == [0, 1] and views[0]["world_size"] == 2
        assert len(set(first)) == 2 and os.getpid() not in first and ranks.starts == 1

        with pytest.raises(TypeError) as raised:  # a worker's error, raised on every rank
            ranks.run(workers.ddp_window)
        assert str(raised.value).startswith(f"rank {raised.value.rank}: ")
        assert "missing 3 required positional arguments" in str(raised.value)
        assert not ranks.running  # the group ended with the error

        again = ranks.run(os.getpid)  # a new group, new processes
        assert ranks.starts == 2 and not set(again) & set(first)
    assert not ranks.running
