"""The ``accumlab`` command a user can trust: a resume the checkpoint refuses is one line
naming what changed, ``--record`` never replaces what its path is, every failure is one
line, a full disk names the file, Ctrl-C says where to resume from, a run that has
trained exits as done however late Ctrl-C comes, and ``--help``/``--version`` read as
plain text."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers import commands  # tests/helpers/commands.py
from helpers.commands import one_line

from accumlab import checkpoint
from accumlab_course.cli import build_parser, main

TINY = ["train", "--micro", "2", "--steps", "2", "--updates", "1", "--examples", "8", "--quiet"]
SMALL = ["train", "--micro", "2", "--steps", "2", "--examples", "24", "--quiet"]


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if the command starts training (it must refuse before that)."""
    import accumlab.driver

    def refuse(*args, **kwargs):
        raise AssertionError("training started although the command should have refused")

    monkeypatch.setattr(accumlab.driver, "train", refuse)


@pytest.fixture
def ckpt_run(tmp_path):
    """A run of 2 update attempts with a checkpoint after each (fp32, lr 3e-3, seed 0)."""
    ckpt = tmp_path / "ckpt"
    assert main([*SMALL, "--updates", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]) == 0
    return ckpt


# --- a resume never runs or records a setting other than the checkpoint's -----------------

#: Each flag a resume must keep, a changed value, and how the refusal names it: the flag
#: as typed, the checkpoint's value and the new one (the checkpoint does not record
#: --examples: its line names the flag, the new value and the first window that differs).
CHANGED = [
    ("--micro", "4", "--micro: 2 in the checkpoint, 4 now"),
    ("--steps", "4", "--steps: 2 in the checkpoint, 4 now"),
    ("--last-window", "drop", "--last-window: update in the checkpoint, drop now"),
    ("--examples", "20", "--examples 20 now, but the data is not the checkpoint's run's (window 0 "
                         "(loader microbatches 0-1) holds other examples than the run"),
    ("--seed", "1", "--seed: 0 in the checkpoint, 1 now"),
    ("--precision", "bf16", "--precision: fp32 in the checkpoint, bf16 now"),
    ("--precision", "fp16", "--precision: fp32 in the checkpoint, fp16 now"),
    ("--lr", "0.1", "--lr: 0.003 in the checkpoint, 0.1 now"),
    ("--clip", "0.5", "--clip: not given in the checkpoint, 0.5 now"),
]


@pytest.mark.parametrize("updates", ["4", "2"])  # more to train; the run already complete
@pytest.mark.parametrize(("flag", "value", "named"), CHANGED)
def test_resume_refuses_a_changed_setting_naming_it(ckpt_run, tmp_path, capsys, flag, value,
                                                    named, updates):
    """In the command's words: the flag as typed, never the checkpoint's own names of what
    it compares (``plan: micro_batch_size``, ``optimizer param_groups[0]['lr']``, the
    GradScaler that --precision fp16 brings, the effective batch that --micro changes)."""
    before = {p.name: p.read_bytes() for p in ckpt_run.iterdir()}
    record = tmp_path / "resumed.json"
    code = main([*SMALL, "--updates", updates, "--checkpoint-dir", str(ckpt_run), "--resume",
                 flag, value, "--record", str(record)])
    assert code == 2
    captured = capsys.readouterr()
    line = one_line(captured.err)
    assert line.startswith(f"accumlab: error: cannot resume from the checkpoint in {ckpt_run}: "
                           "the run that wrote it had other flags: " + named), line
    for library_words in ("plan:", "param_groups", "initial_seed", "GradScaler", "effective"):
        assert library_words not in line, line
    assert "another --checkpoint-dir" in line  # the other way out: a new run directory
    assert not record.exists()  # nothing recorded for a run that did not happen
    assert {p.name: p.read_bytes() for p in ckpt_run.iterdir()} == before  # nothing written


def test_a_resume_names_every_changed_flag(ckpt_run, capsys):
    assert main([*SMALL, "--updates", "4", "--checkpoint-dir", str(ckpt_run), "--resume",
                 "--micro", "4", "--lr", "0.1", "--clip", "2"]) == 2
    line = one_line(capsys.readouterr().err)
    assert ("had other flags: --micro: 2 in the checkpoint, 4 now; --clip: not given in the "
            "checkpoint, 2.0 now; --lr: 0.003 in the checkpoint, 0.1 now. ") in line, line


def test_resume_with_the_same_settings_still_runs(ckpt_run, tmp_path, capsys):
    record = tmp_path / "resumed.json"
    assert main([*SMALL, "--updates", "3", "--checkpoint-dir", str(ckpt_run), "--resume",
                 "--record", str(record)]) == 0
    written = json.loads(record.read_text())
    assert written["update_attempts"] == 3
    assert written["extra"]["learning_rate"] == written["lr_first"] == written["lr_last"] == 3e-3


def test_a_resume_with_no_checkpoint_yet_takes_the_new_settings(tmp_path, capsys):
    """Killed before the first checkpoint: --resume starts fresh, with the flags given now."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert main([*TINY, "--lr", "0.01", "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    assert f"no checkpoint in {ckpt} yet: starting fresh" in capsys.readouterr().out
    state = checkpoint.load_checkpoint(checkpoint.checkpoint_path(ckpt, 1))
    assert state["settings"]["hyperparameters"][0]["lr"] == 0.01


# --- --record writes through a symlink and refuses what is not a regular file -------------


def test_force_writes_through_a_symlink_to_its_target(tmp_path, capsys):
    target = tmp_path / "records" / "real.json"
    target.parent.mkdir()
    target.write_text("earlier run\n")
    link = tmp_path / "run.json"
    link.symlink_to(target)
    assert main([*TINY, "--record", str(link), "--force"]) == 0
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert json.loads(target.read_text())["update_attempts"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records", "run.json"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["real.json"]  # no temp left


def test_a_dangling_symlink_is_written_through_to_its_target(tmp_path, capsys):
    target = tmp_path / "real.json"
    link = tmp_path / "run.json"
    link.symlink_to(target)
    assert main([*TINY, "--record", str(link)]) == 0
    assert link.is_symlink() and json.loads(target.read_text())["update_attempts"] == 1


def test_a_record_replaced_keeps_its_permissions_and_a_new_one_follows_the_umask(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text("earlier run\n")
    old.chmod(0o640)
    assert main([*TINY, "--record", str(old), "--force"]) == 0
    assert old.stat().st_mode & 0o777 == 0o640
    umask = os.umask(0o027)
    try:
        assert main([*TINY, "--record", str(tmp_path / "new.json")]) == 0
    finally:
        os.umask(umask)
    assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o640  # 0o666 less 0o027


@pytest.mark.parametrize("kind", ["fifo", "symlink_to_fifo", "symlink_to_directory"])
@pytest.mark.parametrize("force", [False, True])
def test_record_refuses_what_is_not_a_regular_file(tmp_path, capsys, no_training, kind, force):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    path = tmp_path / "run.json"
    if kind == "fifo":
        path = fifo
    else:
        path.symlink_to(fifo if kind == "symlink_to_fifo" else tmp_path / "dir")
    assert main([*TINY, "--record", str(path), *(["--force"] if force else [])]) == 1
    line = one_line(capsys.readouterr().err)
    assert str(path) in line and "not a regular file" in line, line
    assert fifo.is_fifo() and (tmp_path / "dir").is_dir()  # nothing replaced
    if kind != "fifo":
        assert path.is_symlink()


def test_a_fifo_put_at_the_record_path_during_training_is_left_alone(tmp_path, capsys, monkeypatch):
    """Checked before training and again at the rename: what appeared meanwhile is kept."""
    import accumlab.driver

    path = tmp_path / "run.json"
    real_train = accumlab.driver.train

    def train_then_fifo(*args, **kwargs):
        ledger = real_train(*args, **kwargs)
        os.mkfifo(path)
        return ledger

    monkeypatch.setattr(accumlab.driver, "train", train_then_fifo)
    assert main([*TINY, "--record", str(path), "--force"]) == 1
    captured = capsys.readouterr()
    assert "is a FIFO (named pipe), not a regular file" in one_line(captured.err)
    assert path.is_fifo() and '"update_attempts": 1' in captured.out  # the record is not lost
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # no temp file left


# --- the record and the checkpoints must not collide (checked before training) -------------


@pytest.mark.parametrize("where", ["same", "checkpoint_name", "lock_name", "above"])
def test_record_and_checkpoint_dir_that_collide_are_refused(tmp_path, capsys, no_training, where):
    ckpt = tmp_path / "ckpt"
    record = {"same": ckpt, "checkpoint_name": ckpt / "checkpoint-00000001-rank0.pt",
              "lock_name": ckpt / ".checkpoint-lock", "above": tmp_path}[where]
    if where == "above":
        ckpt = tmp_path / "run.json" / "ckpt"
        record = tmp_path / "run.json"
    assert main([*TINY, "--record", str(record), "--checkpoint-dir", str(ckpt)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--record" in line and "--checkpoint-dir" in line, line
    assert not ckpt.exists() and not record.exists()


def test_a_record_beside_the_checkpoints_is_fine(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main([*TINY, "--record", str(ckpt / "run.json"), "--checkpoint-dir", str(ckpt)]) == 0
    assert json.loads((ckpt / "run.json").read_text())["update_attempts"] == 1


# --- damaged checkpoints, a full disk: one line -------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_corrupt_newest_checkpoint_is_one_line(ckpt_run, capsys, damage):
    newest = ckpt_run / "checkpoint-00000002-rank0.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    # the library falls back to the previous checkpoint, and the command says so in one line
    assert main([*SMALL, "--updates", "3", "--checkpoint-dir", str(ckpt_run), "--resume"]) == 0
    captured = capsys.readouterr()
    line = one_line(captured.err)
    assert line.startswith("accumlab: warning: ") and newest.name in line, line
    assert "| update_attempts | 3 |" in captured.out


def test_every_checkpoint_damaged_is_one_line_and_exit_1(ckpt_run, capsys):
    """The library raises one error naming every damaged file (no warning before it): one
    line, exit 1 (not a usage error)."""
    for name in ("checkpoint-00000001-rank0.pt", "checkpoint-00000002-rank0.pt"):
        (ckpt_run / name).write_bytes(b"")
    assert main([*SMALL, "--updates", "3", "--checkpoint-dir", str(ckpt_run), "--resume"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("accumlab: error: no intact checkpoint in ")
    assert "checkpoint-00000001" in line and "checkpoint-00000002" in line


def test_a_checkpoint_of_another_format_is_one_line_and_exit_1(ckpt_run, capsys):
    """Intact checkpoints of another accumlab's format: not a damaged file, not a bad flag
    (exit 1, like a directory with no intact checkpoint); the line names the format."""
    for attempts in checkpoint.list_checkpoints(ckpt_run):
        state = checkpoint.load_checkpoint(checkpoint.checkpoint_path(ckpt_run, attempts))
        checkpoint.save_checkpoint({**state, "format": checkpoint.FORMAT - 1}, ckpt_run, attempts)
    assert main([*SMALL, "--updates", "3", "--checkpoint-dir", str(ckpt_run), "--resume"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("accumlab: error: cannot resume from "), line
    assert f"it is a checkpoint of format {checkpoint.FORMAT - 1}" in line
    assert line.endswith("start the run in a new --checkpoint-dir"), line


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE and fork")
def test_a_file_size_limit_during_a_checkpoint_write_names_the_file(tmp_path, capsys):
    """Checkpoints grow with every attempt (the ledger), so a file-size limit between the
    sizes of checkpoints 2 and 3 lets 1 and 2 be written and stops 3: one line naming
    checkpoint 3 and the limit, 1 and 2 left intact; the resume trains attempt 3 and fails
    on the same write with the same line (not "before the first update attempt"); without
    the limit the resume ends with the record of a run never stopped.

    Each limited run is a child forked from this process with its own limit. The sizes
    come from a run in a child like them: a checkpoint holds the state of Python's
    ``random``, whose pickled size (and so the checkpoint's, by 64 bytes at a time) differs
    from one interpreter's seed to another's, where the checkpoints grow by 128 bytes an
    attempt; the children seed it alike, so the sizes are the same in every child."""
    sized = tmp_path / "sized"
    done = commands.forked(*SMALL, "--updates", "3", "--checkpoint-dir", str(sized), "--checkpoint-every", "1")
    assert done.returncode == 0, done.stderr
    second, third = (checkpoint.checkpoint_path(sized, n).stat().st_size for n in (2, 3))
    assert second < third
    ckpt = tmp_path / "ckpt"
    flags = [*SMALL, "--updates", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    third_path = checkpoint.checkpoint_path(ckpt, 3)
    for resume in ([], ["--resume"]):
        result = commands.forked(*flags, *resume, file_size_limit=(second + third) // 2)
        assert result.returncode == 1, result.stderr
        line = one_line(result.stderr)
        assert line == (f"accumlab: error: cannot write {third_path}: File too large (over a "
                        "file-size limit: the process's `ulimit -f`, or the file system's); the "
                        "checkpoints written before it are intact"), line
        assert checkpoint.list_checkpoints(ckpt) == [2, 1]
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "checkpoint-00000001-rank0.pt", "checkpoint-00000002-rank0.pt"]  # no temp, no lock
        checkpoint.load_checkpoint(checkpoint.checkpoint_path(ckpt, 2))  # intact
    assert main([*flags, "--resume", "--record", str(tmp_path / "resumed.json")]) == 0
    assert main([*flags[:-4], "--record", str(tmp_path / "straight.json")]) == 0
    assert json.loads((tmp_path / "resumed.json").read_text()) == json.loads((tmp_path / "straight.json").read_text())


def test_a_full_disk_while_writing_the_record_keeps_the_old_file_and_prints_it(tmp_path, capsys, monkeypatch):
    import accumlab.atomic_write

    path = tmp_path / "run.json"
    path.write_text("earlier run\n")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(accumlab.atomic_write.os, "replace", full_disk)
    assert main([*TINY, "--record", str(path), "--force"]) == 1
    captured = capsys.readouterr()
    assert path.read_text() == "earlier run\n"  # the old record is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # temp file removed
    assert '"update_attempts": 1' in captured.out  # the record is not lost
    assert one_line(captured.err) == (f"accumlab: error: cannot write {path}: No space left on "
                                      "device; the run record's JSON is printed above instead")


def test_a_library_warning_is_one_line(monkeypatch, capsys):
    import warnings

    import accumlab.driver

    def warn_then_fail(*args, **kwargs):
        warnings.warn("checkpoint-00000002-rank0.pt is corrupt\n(truncated); using the one before",
                      UserWarning, stacklevel=2)
        raise RuntimeError("PytorchStreamReader failed reading zip archive:\nfailed finding central directory")

    monkeypatch.setattr(accumlab.driver, "train", warn_then_fail)
    assert main(TINY) == 1
    assert capsys.readouterr().err.splitlines() == [
        "accumlab: warning: checkpoint-00000002-rank0.pt is corrupt (truncated); using the one before",
        "accumlab: error: PytorchStreamReader failed reading zip archive: failed finding central directory",
    ]


@pytest.mark.parametrize("error", [RuntimeError, OSError, EOFError, ValueError])
def test_any_failure_of_training_is_one_line(monkeypatch, capsys, error):
    import accumlab.driver

    def fail(*args, **kwargs):
        raise error("it broke\nsecond line")

    monkeypatch.setattr(accumlab.driver, "train", fail)
    assert main(TINY) != 0
    assert one_line(capsys.readouterr().err) == "accumlab: error: it broke second line"


# --- odd bytes in paths, a terminal that cannot show them, output that fails ----------------


def test_a_path_that_is_not_utf8_is_printed_and_a_finished_run_exits_0(tmp_path, capsys):
    """A checkpoint directory and a record whose names hold bytes that are not UTF-8 (as a
    file copied from another system may), printed on a UTF-8 stdout: the bytes show as
    \\xff, and the run that wrote its record exits 0 (it was exit 2, "bad arguments",
    after the record was written: printing the path raised UnicodeEncodeError)."""
    odd = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9-\xff")  # latin-1 "café", then 0xff
    ckpt, record = odd + "/ckpt", odd + "/run.json"
    assert main([*TINY, "--checkpoint-dir", ckpt, "--record", record]) == 0
    assert main([*TINY, "--updates", "2", "--checkpoint-dir", ckpt, "--resume", "--record", record,
                 "--force"]) == 0
    shown = f"{tmp_path}/caf\\xe9-\\xff"
    out = capsys.readouterr().out
    assert f"resuming from {shown}/ckpt/checkpoint-00000001-rank0.pt" in out
    assert f"run record written to {shown}/run.json" in out
    assert json.loads(Path(record).read_text())["update_attempts"] == 2


def test_characters_the_terminal_cannot_show_are_escaped(tmp_path, capsys, monkeypatch):
    """A valid UTF-8 name on a terminal whose encoding lacks its characters (latin-1)."""
    import io

    latin1 = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")
    monkeypatch.setattr(sys, "stdout", latin1)
    record = tmp_path / "日本-ü.json"
    assert main([*TINY, "--record", str(record)]) == 0
    latin1.flush()
    out = latin1.buffer.getvalue().decode("latin-1")
    assert f"run record written to {tmp_path}/\\u65e5\\u672c-ü.json" in out
    assert json.loads(record.read_text())["update_attempts"] == 1


def test_a_stdout_that_fails_does_not_fail_a_finished_run(tmp_path, capsys, monkeypatch):
    """stdout on a full disk (``> /dev/full``): the run finished and wrote its record, so
    it exits 0, saying on stderr that its output was lost (it was exit 1, "No space left
    on device", the record written)."""
    full = open("/dev/full", "w")  # noqa: SIM115 (closed below)
    monkeypatch.setattr(sys, "stdout", full)
    try:
        assert main([*TINY, "--record", str(tmp_path / "run.json")]) == 0
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):
            full.close()
    assert json.loads((tmp_path / "run.json").read_text())["update_attempts"] == 1
    assert one_line(capsys.readouterr().err) == (
        "accumlab: warning: the command finished (exit 0), but its output could not all be "
        "printed (stdout: No space left on device)")


@pytest.mark.parametrize("flag", ["--examples", "--updates", "--seed"])
def test_a_number_of_5000_digits_is_called_too_large(flag, capsys):
    """Not "must be a whole number, got '777...'" (5,000 digits quoted) because Python's
    int() reads at most 4,300 digits."""
    with pytest.raises(SystemExit) as exit_:
        main([*TINY, flag, "7" * 5000])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"accumlab train: error: argument {flag}: must be a whole number")
    assert last.endswith(", got a number of 5000 digits (too large)"), last


def test_a_record_path_that_cannot_be_looked_up_names_it(tmp_path, capsys, no_training):
    loop = tmp_path / "run.json"
    loop.symlink_to(loop)
    assert main([*TINY, "--record", str(loop)]) == 1
    assert one_line(capsys.readouterr().err) == (
        f"accumlab: error: cannot look up --record {loop}: Too many levels of symbolic links")


def test_a_failed_run_leaves_no_directory_it_made(tmp_path, capsys, monkeypatch):
    """The record's directories, made before training to prove it can be written, and the
    checkpoint directory go again when the run fails before writing anything there."""
    import accumlab.driver

    real_train = accumlab.driver.train

    def fail_in_training(*args, **kwargs):
        kwargs["on_update"] = lambda report: (_ for _ in ()).throw(RuntimeError("it broke"))
        return real_train(*args, **kwargs)

    monkeypatch.setattr(accumlab.driver, "train", fail_in_training)
    assert main([*TINY, "--record", str(tmp_path / "runs" / "new" / "run.json"),
                 "--checkpoint-dir", str(tmp_path / "runs" / "ckpt")]) == 1
    assert one_line(capsys.readouterr().err) == "accumlab: error: it broke"
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_dir_that_is_a_dangling_symlink_says_so(tmp_path, capsys):
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "gone")
    assert main([*TINY, "--checkpoint-dir", str(link)]) == 1
    assert one_line(capsys.readouterr().err) == (
        f"accumlab: error: cannot write checkpoints to --checkpoint-dir {str(link)!r} (it is a "
        f"symlink to {tmp_path / 'gone'}, which does not exist); give a directory you can write to")


# --- Ctrl-C ----------------------------------------------------------------------------------


def test_ctrl_c_without_checkpoints_is_one_line(monkeypatch, capsys):
    import accumlab.driver

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(accumlab.driver, "train", interrupted)
    assert main(TINY) == 130
    line = one_line(capsys.readouterr().err)
    assert line == "accumlab: interrupted; no checkpoint was written (no --checkpoint-dir)"


def _wait_for(path: Path, process, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.002)


@pytest.mark.parametrize("tests_ignore_ctrl_c", [False, True])
def test_ctrl_c_names_the_last_checkpoint(tmp_path, tests_ignore_ctrl_c):
    """A real SIGINT in the middle of a run: exit 130, one line naming the newest checkpoint
    and how to continue from it; also when the tests themselves run with SIGINT ignored
    (`nohup make test`, a background job): the command gets Ctrl-C's default back."""
    ckpt = tmp_path / "ckpt"
    ours = signal.signal(signal.SIGINT, signal.SIG_IGN) if tests_ignore_ctrl_c else None
    try:
        process = commands.start("train", "--micro", "1", "--steps", "1", "--updates", "100000",
                                 "--quiet", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1")
    finally:
        if ours is not None:
            signal.signal(signal.SIGINT, ours)
    try:
        _wait_for(checkpoint.checkpoint_path(ckpt, 1), process)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, err
    line = one_line(err)
    newest = max(ckpt.glob("checkpoint-*-rank0.pt"))
    assert line.startswith("accumlab: interrupted; ")
    assert str(newest) in line and "--resume" in line, line


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.1, 0.2])
def test_ctrl_c_after_the_last_checkpoint_of_a_finished_run_exits_as_done(tmp_path, delay):
    """SIGINT ``delay`` seconds after the run's last checkpoint appeared: the run has
    trained, so it ends as it would have: exit 0, its record printed, nothing on stderr
    (not killed by the signal during the interpreter's exit, silent, nor a traceback from
    an exit handler)."""
    ckpt = tmp_path / "ckpt"
    process = commands.start(*SMALL, "--updates", "3", "--checkpoint-dir", str(ckpt))
    try:
        _wait_for(checkpoint.checkpoint_path(ckpt, 3), process)
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert (process.returncode, err) == (0, ""), (process.returncode, err)
    assert "| update_attempts | 3 |" in out


def test_an_ignored_ctrl_c_stays_ignored():
    """A background job started with SIGINT ignored: the command never turns Ctrl-C back
    on (neither a KeyboardInterrupt nor its line), from its start to its exit."""
    process = commands.start(*TINY, ignore_ctrl_c=True)
    try:
        for _ in range(8):
            time.sleep(0.25)
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "interrupted" not in err and "| update_attempts | 1 |" in out


def test_main_leaves_ctrl_c_as_it_found_it(monkeypatch, capsys):
    """Called from Python (a test, a script), the command hands Ctrl-C back as it was,
    after a run (which ignores it once trained) and after an interruption alike."""
    import accumlab.driver

    before = signal.getsignal(signal.SIGINT)
    assert main(TINY) == 0
    assert signal.getsignal(signal.SIGINT) is before
    monkeypatch.setattr(accumlab.driver, "train", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(TINY) == 130
    assert signal.getsignal(signal.SIGINT) is before


# --- smaller -------------------------------------------------------------------------------


def test_version(capsys):
    import accumlab

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"accumlab {accumlab.__version__}"


def test_help_is_plain_text():
    parser = build_parser()
    texts = [parser.format_help()]
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    texts += [p.format_help() for p in subparsers.choices.values()]
    for text in texts:
        assert "``" not in text and ":func:" not in text, text
    assert texts[0].splitlines()[2].startswith("The accumlab command: ")
