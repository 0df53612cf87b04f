"""batch_samples calls get_batch_samples the way the installed release does: transformers
4.46-4.47 take (epoch_iterator, num_batches), later releases add device. The audit's own
count fix sets a wrapper taking *device on the instance; the release is read off the
Trainer's class, so under 4.46 the wrapper is called without device (before, the audit
read the wrapper's signature, passed device, and 4.46's method raised TypeError)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("transformers")

from accumlab.hf.steps import batch_samples  # noqa: E402


class Old:
    """get_batch_samples as in transformers 4.46."""

    def get_batch_samples(self, epoch_iterator, num_batches):
        return [next(epoch_iterator) for _ in range(num_batches)], None


class New:
    """get_batch_samples as in transformers 4.48 and later."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return [next(epoch_iterator) for _ in range(num_batches)], device


def wrapped(trainer):
    inner = trainer.get_batch_samples

    def counted(self, epoch_iterator, num_batches, *device):
        batches, _ = inner(epoch_iterator, num_batches, *device)
        return batches, len(batches)

    trainer.get_batch_samples = types.MethodType(counted, trainer)
    return trainer


@pytest.mark.parametrize("cls", [Old, New])
def test_the_release_decides_whether_device_is_passed(cls):
    assert batch_samples(cls(), iter(range(5)), 2, "cpu") == ([0, 1], None if cls is Old else "cpu")
    assert batch_samples(wrapped(cls()), iter(range(5)), 3, "cpu") == ([0, 1, 2], 3)
