"""``launch`` names the rank that died: a rank killed with SIGKILL is reported as
that rank and its signal, not as the survivor's secondary "Connection reset by peer"."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from accumlab import distributed as ald


def killed_rank(victim: int) -> str:
    """Rank ``victim`` kills itself with SIGKILL after one all-reduce; the others keep
    calling all-reduce, so gloo fails them with a connection error of their own."""
    rank = dist.get_rank()
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached
    for _ in range(1000):
        dist.all_reduce(x)
        time.sleep(0.01)
    return "unreachable: the peer is dead"


@pytest.mark.distributed
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_is_named_with_its_signal(victim):
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ald.launch(killed_rank, 2, (victim,), timeout_s=20, deadline_s=60)
    message = str(info.value)
    first = message.splitlines()[0]
    assert first.startswith(f"launch: rank {victim} was killed by signal SIGKILL"), message
    assert getattr(info.value, "rank", None) == victim
    assert time.monotonic() - start < 40  # not the process-group timeout
