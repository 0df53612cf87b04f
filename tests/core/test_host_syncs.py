"""How often a window waits for the device: host syncs counted with a dispatch mode.

A host sync is a tensor read back as a Python number (``.item()``, ``float(t)``,
``int(t)``, ``bool(t)``): every one of them reaches ``aten._local_scalar_dense``, and on
a GPU each stalls the host until the device catches up. The loop counts each
microbatch's targets on the CPU before any forward pass (one read per microbatch of a
CPU tensor, no device involved); everything else it reads back must happen once per
window, at the boundary, never once per microbatch.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from helpers.batches import token_batch
from helpers.models import CausalToy
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import accumlab as al


class HostSyncs(TorchDispatchMode):
    """Counts reads of a tensor back into Python (``aten._local_scalar_dense``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def window(a: int, seed: int = 0) -> list[dict[str, Tensor]]:
    return [token_batch([(7, 2), (5, 1)], seed=seed + i) for i in range(a)]


def syncs_of_counting(batch: Mapping[str, Tensor]) -> int:
    with HostSyncs() as mode:
        al.NextTokenLoss().count(batch)
    return mode.count


def syncs_per_window(a: int, precision: str) -> int:
    torch.manual_seed(0)
    model = CausalToy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    batches = window(a)
    al.train_window(model, batches, optimizer, al.NextTokenLoss(), precision=precision,
                    scaler=scaler, clip_grad_norm=1.0)  # warm-up: lazy state is built once
    with HostSyncs() as mode:
        report = al.train_window(model, batches, optimizer, al.NextTokenLoss(),
                                 precision=precision, scaler=scaler, clip_grad_norm=1.0)
    assert report.applied
    return mode.count


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_no_host_sync_per_microbatch_beyond_the_cpu_count(precision: str) -> None:
    per_count = syncs_of_counting(window(1)[0])
    small, large = syncs_per_window(2, precision), syncs_per_window(8, precision)
    # six more microbatches cost six more CPU counts and nothing else
    assert large - small == 6 * per_count, (small, large, per_count)


# fp32/bf16: the window's loss sum and the gradient norm. fp16 adds the scale read before
# and after the window and the GradScaler's own inf check inside ``scaler.step``.
@pytest.mark.parametrize(("precision", "most"), [("fp32", 2), ("bf16", 2), ("fp16", 5)])
def test_host_syncs_at_the_boundary(precision: str, most: int) -> None:
    a = 3
    boundary = syncs_per_window(a, precision) - a * syncs_of_counting(window(1)[0])
    print(f"{precision}: {boundary} host syncs per window besides the CPU counts")
    assert boundary <= most
