"""The checkpoint layer (atomic files, what a full disk leaves, the newest complete
checkpoint, refusals, RNG states), the ledger as plain data, and the run record that
comes from the run."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import resume_workers as workers  # tests/helpers/resume_workers.py

import accumlab as al
from accumlab import checkpoint
from accumlab.ledger import Ledger
from accumlab.record import RunRecord
from accumlab.report import UpdateReport
from accumlab.settings import TrainSettings


def report(
    index: int, applied: bool = True, loss: float = 1.5, grad_norm: float = 2.0
) -> UpdateReport:
    return UpdateReport(
        index=index,
        applied=applied,
        examples=4,
        targets=40,
        global_targets=40,
        microbatches=2,
        backward_passes=2,
        loss=loss,
        loss_sum=loss * 40,
        grad_norm=grad_norm,
        lr=1e-3 * (index + 1),
        skipped_reason=None if applied else "non-finite gradient",
    )


def sample_ledger() -> Ledger:
    ledger = Ledger(loader_batches=6, largest_microbatch=2)
    ledger.record(report(0, grad_norm=3.0))
    ledger.record(report(1, applied=False, loss=math.nan, grad_norm=math.inf))
    ledger.record(report(2, grad_norm=5.0))
    ledger.shrinks.append({"update": 1, "old_micro_batch_size": 2, "new_micro_batch_size": 1, "microbatches": 4})
    ledger.settings = {"precision": "fp16", "scaler": {"enabled": True, "scale": 1024.0}, "unit": "target"}
    return ledger


# ----------------------------------------------------------------- the ledger as plain data


def test_ledger_state_round_trips_through_a_weights_only_load(tmp_path: Path) -> None:
    ledger = sample_ledger()
    torch.save(ledger.state_dict(), tmp_path / "ledger.pt")
    state = torch.load(tmp_path / "ledger.pt", weights_only=True)  # plain data only
    restored = Ledger()
    restored.load_state_dict(state)
    assert workers.mismatches(restored.state_dict(), ledger.state_dict()) == []
    assert restored.reports[1].skipped_reason == "non-finite gradient"
    assert math.isnan(restored.reports[1].loss) and restored.reports[1].grad_norm == math.inf
    assert restored.summary() == ledger.summary()
    restored.shrinks[0]["update"] = 99  # a copy, not the same lists
    assert ledger.shrinks[0]["update"] == 1


def test_ledger_load_state_dict_names_missing_and_unknown_fields() -> None:
    state = Ledger().state_dict()
    del state["examples"]
    state["tokens"] = 3
    with pytest.raises(ValueError, match=r"missing fields \['examples'\], unknown fields \['tokens'\]"):
        Ledger().load_state_dict(state)
    with pytest.raises(TypeError, match="state must be a dict"):
        Ledger().load_state_dict([])  # type: ignore[arg-type]


def test_ledger_state_dict_refuses_what_is_not_plain_data() -> None:
    ledger = Ledger()
    ledger.settings = {"optimizer": torch.optim.SGD}
    with pytest.raises(TypeError, match=r"Ledger.settings\['optimizer'\] must hold plain data only"):
        ledger.state_dict()


# ----------------------------------------------------------------- the record: strict JSON


def test_record_json_is_strict_with_non_finite_numbers_anywhere() -> None:
    plan = al.AccumulationPlan(2, 2)
    extra = {"nan": math.nan, "nested": {"inf": [1.0, math.inf, -math.inf]}, "pair": (math.nan, 2)}
    record = RunRecord.from_run(plan, sample_ledger(), extra=extra)
    text = record.to_json()
    data = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-strict JSON: {name}"))
    assert data["extra"]["nan"] is None
    assert data["extra"]["nested"] == {"inf": [1.0, None, None]}
    assert data["extra"]["pair"] == [None, 2]
    back = RunRecord.from_json(text)
    assert back.to_json() == text
    assert back.extra["nested"]["inf"] == [1.0, None, None]
    assert (back.precision, back.scaler, back.grad_norm_largest) == ("fp16", {"enabled": True, "scale": 1024.0}, 5.0)


def test_record_from_json_refuses_what_is_not_a_record() -> None:
    good = json.loads(RunRecord.from_run(al.AccumulationPlan(2, 2), Ledger()).to_json())
    with pytest.raises(ValueError, match="not JSON"):
        RunRecord.from_json("{")
    with pytest.raises(ValueError, match="expected a JSON object"):
        RunRecord.from_json("[1]")
    del good["targets"]
    good["steps"] = 3
    with pytest.raises(ValueError, match=r"missing fields \['targets'\], unknown fields \['steps'\]"):
        RunRecord.from_json(json.dumps(good))


# ----------------------------------------------------------------- the record comes from the run


def test_record_keywords_still_work_for_a_ledger_built_by_hand() -> None:
    ledger = Ledger()
    record = RunRecord.from_run(al.AccumulationPlan(2, 2), ledger, unit="example", precision="bf16")
    assert (record.unit, record.precision) == ("example", "bf16")
    default = RunRecord.from_run(al.AccumulationPlan(2, 2), ledger)
    assert (default.unit, default.precision, default.scaler) == ("target", "fp32", None)
    noted = RunRecord.from_run(al.AccumulationPlan(2, 2), sample_ledger())
    assert (noted.precision, noted.scaler) == ("fp16", {"enabled": True, "scale": 1024.0})


# ----------------------------------------------------------------- files


def test_save_is_atomic_keeps_the_newest_two_and_ignores_leftovers(tmp_path: Path) -> None:
    for attempts in (1, 2, 3):
        checkpoint.save_checkpoint({"format": checkpoint.FORMAT, "n": attempts}, tmp_path, attempts)
    assert checkpoint.list_checkpoints(tmp_path) == [3, 2]
    # A write killed midway leaves a temporary file: never listed, removed by the next write.
    leftover = tmp_path / ".checkpoint-00000004-rank0.pt.abc.tmp"
    other_rank = tmp_path / ".checkpoint-00000004-rank1.pt.abc.tmp"  # not this rank's to remove
    other_rank.write_bytes(b"")
    leftover.write_bytes(b"half a checkpoint")
    assert checkpoint.list_checkpoints(tmp_path) == [3, 2]
    checkpoint.save_checkpoint({"format": checkpoint.FORMAT, "n": 4}, tmp_path, 4)
    assert not leftover.exists()
    other_rank.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-00000003-rank0.pt",
        "checkpoint-00000004-rank0.pt",
    ]
    assert checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path, 4))["n"] == 4


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    checkpoint.save_checkpoint({"format": checkpoint.FORMAT, "n": 1}, tmp_path, 1)
    with pytest.raises(Exception):  # noqa: B017 - pickling a lambda fails inside torch.save
        checkpoint.save_checkpoint({"format": checkpoint.FORMAT, "f": lambda: 0}, tmp_path, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-00000001-rank0.pt"]
    assert checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path, 1))["n"] == 1
    assert checkpoint.newest_common(tmp_path) == 1


class FullDisk(io.RawIOBase):
    """A file on a disk with ``room`` bytes left: a write past it raises ENOSPC, as the
    kernel does (a part first, then the error)."""

    def __init__(self, fd: int, room: int) -> None:
        self.file, self.room = io.FileIO(fd, "wb"), room

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = self.file.write(bytes(data)[: self.room])
        self.room -= written
        return written

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.file.close()
        super().close()


def test_a_full_disk_during_a_write_names_the_file_and_keeps_the_older_ones(tmp_path, monkeypatch):
    """torch.save reports a failed write as "[enforce fail at inline_container.cc] ...
    unexpected pos"; the checkpoint layer says what happened, naming the file."""
    import accumlab.atomic_write

    state = {"format": checkpoint.FORMAT, "w": torch.arange(10_000.0)}
    checkpoint.save_checkpoint(state, tmp_path, 1)
    size = checkpoint.checkpoint_path(tmp_path, 1).stat().st_size
    for room in (0, 100, size // 2, size - 1):
        monkeypatch.setattr(accumlab.atomic_write.os, "fdopen",
                            lambda fd, *a, room=room, **k: FullDisk(fd, room))
        with pytest.raises(OSError) as info:
            checkpoint.save_checkpoint(state, tmp_path, 2)
        monkeypatch.undo()
        assert info.value.errno == errno.ENOSPC
        assert str(info.value) == (
            f"[Errno {errno.ENOSPC}] cannot write {checkpoint.checkpoint_path(tmp_path, 2)}: No space "
            "left on device; the checkpoints written before it are intact"
        )
        assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-00000001-rank0.pt"]  # no temp
        assert torch.equal(checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path, 1))["w"], state["w"])


def test_a_write_keeps_a_replaced_files_mode_and_never_replaces_a_link(tmp_path):
    from accumlab.atomic_write import NotARegularFileError, write_atomically

    target = tmp_path / "data.bin"
    target.write_bytes(b"old")
    target.chmod(0o600)
    write_atomically(target, b"new")
    assert target.read_bytes() == b"new" and target.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        write_atomically(target, b"newer", overwrite=False)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(NotARegularFileError, match="is a symlink, not a regular file; it was left alone"):
        write_atomically(link, lambda f: f.write(b"through the link"))
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin", "link"]  # no temp left


def test_load_is_weights_only(tmp_path: Path) -> None:
    path = checkpoint.checkpoint_path(tmp_path, 1)
    torch.save({"format": checkpoint.FORMAT, "object": Path("x")}, path)  # not plain data
    with pytest.raises(Exception, match="Weights only load failed"):
        checkpoint.load_checkpoint(path)
    torch.save({"weights": torch.ones(2)}, path)
    with pytest.raises(checkpoint.CorruptCheckpointError, match=f"not an accumlab checkpoint of format {checkpoint.FORMAT} .found None"):
        checkpoint.load_checkpoint(path)


def test_newest_common_with_one_process(tmp_path: Path) -> None:
    assert checkpoint.newest_common(tmp_path / "none") is None
    (tmp_path / "checkpoint-00000007-rank1.pt").write_bytes(b"")  # another rank's
    assert checkpoint.newest_common(tmp_path) is None


def test_rng_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(3)
    random.seed(3)
    checkpoint.save_checkpoint({"format": checkpoint.FORMAT, "rng": checkpoint.rng_state()}, tmp_path, 1)
    expected = (torch.rand(5), random.random())
    torch.manual_seed(4)
    random.seed(4)
    checkpoint.set_rng_state(checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path, 1))["rng"])
    assert torch.equal(torch.rand(5), expected[0]) and random.random() == expected[1]


def test_check_compatible_names_every_difference() -> None:
    config = workers.Config()
    run = workers.build(config)
    settings = TrainSettings(scheduler=run["scheduler"])
    ckpt = checkpoint.Checkpointer(settings, run["model"], run["optimizer"], None, run["plan"], run["data"])
    state = ckpt.state()
    state["world_size"] = 2
    other = workers.build(workers.Config(n_embd=8))
    settings = {**state["settings"], "seed": 5, "clip_grad_norm": 0.5}
    message = _refusal(state, plan=al.AccumulationPlan(4, 2), model=other["model"], world_size=1, settings=settings)
    assert "seed (torch.initial_seed()): 1000 in the checkpoint, 5 now" in message
    assert "clip_grad_norm: None in the checkpoint, 0.5 now" in message
    assert "plan: micro_batch_size 2 in the checkpoint, 4 now" in message
    assert "plan: effective_batch_size 4 in the checkpoint, 8 now" in message
    assert "world size: 2 in the checkpoint, 1 now" in message
    assert "model: tok_emb.weight '[32, 16] torch.float32' in the checkpoint, '[32, 8]" in message
    assert "model: and " in message  # more than five model differences are summarised


def test_the_package_docstring_describes_every_entry_of_a_checkpoint(tmp_path: Path) -> None:
    """``accumlab.checkpoint``'s docstring is the one description of a checkpoint's
    contents: every entry a written checkpoint holds is named there, and no entry it no
    longer holds."""
    config = workers.Config()
    workers.train(workers.build(config), config, max_updates=1, checkpoint_dir=tmp_path)
    state = checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path, 1))
    entries = {*state, "sha256", *state["data"], *state["data_history"]}
    described = set(re.findall(r"``(\w+)``", checkpoint.__doc__.split("The package is cut by idea")[0]))
    assert entries <= described, f"not described: {sorted(entries - described)}"
    other_words = {"None", "random", "train", *checkpoint.RESUMED_SETTINGS}  # not entries
    assert described - entries <= other_words, sorted(described - entries - other_words)


def _refusal(state: dict[str, Any], **kwargs: Any) -> str:
    with pytest.raises(ValueError, match="cannot resume from this checkpoint") as info:
        checkpoint.check_compatible(state, precision="fp32", scaler=None, **kwargs)
    return str(info.value)


def test_a_refusal_holds_each_difference_with_both_values() -> None:
    """``ResumeMismatchError.differences``: what a caller names in its own words (the
    command names its flags), each with the checkpoint's value and the given one."""
    config = workers.Config()
    run = workers.build(config)
    state = checkpoint.Checkpointer(TrainSettings(), run["model"], run["optimizer"], None,
                                    run["plan"], run["data"]).state()
    run["optimizer"].param_groups[0]["lr"] = 0.5
    settings = {**checkpoint.run_settings(run["optimizer"], TrainSettings(clip_grad_norm=2.0)),
                "seed": state["settings"]["seed"]}
    with pytest.raises(checkpoint.ResumeMismatchError) as info:
        checkpoint.check_compatible(state, plan=al.AccumulationPlan(4, 2), model=run["model"],
                                    world_size=1, precision="bf16", scaler=None, settings=settings)
    found = {(d.what, d.saved, d.now) for d in info.value.differences}
    assert found == {("plan.micro_batch_size", 2, 4), ("plan.effective_batch_size", 4, 8),
                     ("precision", "fp32", "bf16"), ("clip_grad_norm", None, 2.0),
                     ("optimizer.param_groups[0].lr", run["optimizer"].defaults["lr"], 0.5)}
    assert str(info.value) == (
        "cannot resume from this checkpoint, the run differs from the one that wrote it: "
        + "; ".join(d.text for d in info.value.differences) + f". {checkpoint.compare._FIX}")


# --------------------------------------------------------------- file system errors name the file


def test_a_checkpoint_that_cannot_be_opened_is_named_not_called_damaged(tmp_path: Path) -> None:
    """A directory at a checkpoint's name (or no permission) is no damaged checkpoint: an
    OSError saying what could not be done to which file."""
    path = checkpoint.checkpoint_path(tmp_path, 1)
    path.mkdir()
    with pytest.raises(OSError) as info:
        checkpoint.load_checkpoint(path)
    assert not isinstance(info.value, checkpoint.CorruptCheckpointError)
    assert info.value.strerror == f"cannot read checkpoint {path}: Is a directory"


def test_a_checkpoint_directory_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OSError) as info:
        checkpoint.save_checkpoint({"format": checkpoint.FORMAT}, tmp_path / "afile" / "ckpt", 1)
    assert info.value.strerror == (
        f"cannot create the checkpoint directory {tmp_path / 'afile' / 'ckpt'}: Not a directory")


def test_a_rotation_that_cannot_delete_an_old_checkpoint_names_it(tmp_path: Path, monkeypatch: Any) -> None:
    for attempts in (1, 2):
        checkpoint.save_checkpoint({"format": checkpoint.FORMAT}, tmp_path, attempts)
    oldest = checkpoint.checkpoint_path(tmp_path, 1)
    real_unlink = Path.unlink

    def read_only(self: Path, missing_ok: bool = False) -> None:
        if self == oldest:
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(OSError) as info:
        checkpoint.save_checkpoint({"format": checkpoint.FORMAT}, tmp_path, 3)
    assert info.value.strerror == (
        f"cannot delete {oldest} (a checkpoint older than the newest 2, or a write's leftover), "
        "after writing checkpoint-00000003-rank0.pt: Read-only file system")
    assert checkpoint.list_checkpoints(tmp_path) == [3, 2, 1]  # the new one is written


def test_a_directory_that_cannot_be_listed_is_named(tmp_path: Path, monkeypatch: Any) -> None:
    def no_permission(self: Path) -> Any:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "iterdir", no_permission)
    with pytest.raises(OSError) as info:
        checkpoint.list_checkpoints(tmp_path)
    assert info.value.strerror == f"cannot list the checkpoints in {tmp_path}: Permission denied"
