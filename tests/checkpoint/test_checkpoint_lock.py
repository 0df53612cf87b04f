"""A run owns its checkpoint directory: the lock is taken before anything is written, a
second run is refused at once naming the holder, a lock left by a dead process (or a
corrupt one) is taken over with a warning naming the file, and a lock file deleted while
its run lives stops that run at its next checkpoint write, its release leaving alone the
lock another run took since.

The concurrency tests fork real processes (``multiprocessing`` "fork": each child is a
separate process with its own pid and open files, so the kernel's ``flock`` rules are the
ones two scripts meet) and start the second run at a random offset into the first.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import random
import signal
import socket
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from helpers import resume_workers as workers  # tests/helpers/resume_workers.py

import accumlab as al
from accumlab import checkpoint
from accumlab.checkpoint import lock as lock_module
from accumlab.checkpoint import lock_record
from accumlab_course import cli

LOCK = ".checkpoint-lock"
REFUSED = ("in use by another run", "already holds checkpoints")
FORK = multiprocessing.get_context("fork")
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork and flock")


def _hold(directory: str, ready: Any, release: Any) -> None:
    """A child process that holds ``directory``'s lock until ``release`` is set."""
    with checkpoint.DirectoryLock(directory):
        ready.set()
        release.wait(30)


def test_a_second_process_is_refused_at_once_naming_the_holder(tmp_path: Path) -> None:
    ready, release = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        record = json.loads((tmp_path / LOCK).read_text())
        assert (record["pid"], record["host"]) == (holder.pid, socket.gethostname())
        start = time.monotonic()
        with pytest.raises(checkpoint.CheckpointDirectoryInUseError) as info:
            checkpoint.DirectoryLock(tmp_path).acquire()
        assert time.monotonic() - start < 5.0  # refused at once, not after the holder (30 s)
        assert f"in use by another run: process {holder.pid} on host {socket.gethostname()!r}" in str(info.value)
        run = workers.build(workers.Config())
        with pytest.raises(checkpoint.CheckpointDirectoryInUseError, match=f"process {holder.pid}"):
            workers.train(run, workers.Config(), checkpoint_dir=tmp_path, checkpoint_every=1)
        assert checkpoint.list_checkpoints(tmp_path) == []  # nothing was written
    finally:
        release.set()
        holder.join(30)
    assert not (tmp_path / LOCK).exists()  # the holder let go: the file is gone
    with checkpoint.DirectoryLock(tmp_path):
        pass


def test_another_train_call_of_the_process_is_refused(tmp_path: Path) -> None:
    """Another thread, or the same one taking it again (a train() called from on_update)."""
    errors: list[BaseException] = []
    with checkpoint.DirectoryLock(tmp_path):
        with pytest.raises(checkpoint.CheckpointDirectoryInUseError, match="another train.. call of this process"):
            checkpoint.DirectoryLock(tmp_path).acquire()

        def other() -> None:
            try:
                checkpoint.DirectoryLock(tmp_path).acquire()
            except checkpoint.CheckpointDirectoryInUseError as exc:
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert (tmp_path / LOCK).exists()  # still held: the refused ones took nothing
    assert len(errors) == 1 and "another train() call of this process" in str(errors[0])
    assert not (tmp_path / LOCK).exists()


def _killed_mid_run(directory: str) -> None:
    """Train with a checkpoint after every attempt; SIGKILL itself while reading window 3."""
    config = workers.Config(microbatches=8)
    run = workers.build(config)

    def data() -> Any:
        for i, microbatch in enumerate(run["data"]):
            if i == 6:
                os.kill(os.getpid(), signal.SIGKILL)
            yield microbatch

    workers.train(run, config, data(), checkpoint_dir=directory, checkpoint_every=1)


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path: Path) -> None:
    child = FORK.Process(target=_killed_mid_run, args=(str(tmp_path),))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == child.pid  # left behind
    assert checkpoint.list_checkpoints(tmp_path) == [3, 2]
    config = workers.Config(microbatches=8)
    run = workers.build(config)
    with pytest.warns(UserWarning, match=f"taking over the lock left by process {child.pid} .*no longer runs"):
        ledger = workers.train(run, config, checkpoint_dir=tmp_path, resume=True)
    assert ledger.update_attempts == 4
    assert not (tmp_path / LOCK).exists()


# ----------------------------------------------------------------- without flock


def _sleeper() -> None:
    time.sleep(30)


@pytest.fixture
def no_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without flock (Lustre without -o flock): the record alone decides."""
    monkeypatch.setattr(lock_module, "_flock", lambda fd: "unsupported")


def _write_record(directory: Path, **record: Any) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK).write_text(json.dumps({"started": "2026-01-01T00:00:00+00:00", **record}))


def test_without_flock_a_live_holder_on_this_host_is_refused(tmp_path: Path, no_flock: None) -> None:
    live = FORK.Process(target=_sleeper)
    live.start()
    try:
        _write_record(tmp_path, pid=live.pid, host=socket.gethostname(),
                      process_start=lock_record.process_start(live.pid))  # fmt: skip
        with pytest.raises(checkpoint.CheckpointDirectoryInUseError, match=f"process {live.pid}"):
            checkpoint.DirectoryLock(tmp_path).acquire()
    finally:
        live.kill()
        live.join()


def test_without_flock_a_dead_holder_or_a_reused_pid_is_taken_over(tmp_path: Path, no_flock: None) -> None:
    dead = FORK.Process(target=_sleeper)
    dead.start()
    dead.kill()
    dead.join()
    _write_record(tmp_path, pid=dead.pid, host=socket.gethostname(), process_start="1")
    with pytest.warns(UserWarning, match=f"left by process {dead.pid} .*no longer runs"):
        with checkpoint.DirectoryLock(tmp_path) as held:
            assert json.loads((tmp_path / LOCK).read_text()) == held.record
    # The pid of a live process, but not the process that wrote the record (another start).
    _write_record(tmp_path / "reused", pid=os.getpid(), host=socket.gethostname(), process_start="1")
    with pytest.warns(UserWarning, match="taking over"):
        checkpoint.DirectoryLock(tmp_path / "reused").acquire().release()


def test_a_holder_on_another_host_is_never_taken_over(tmp_path: Path) -> None:
    """Even where flock is free (a lock on another NFS client may be invisible here)."""
    _write_record(tmp_path, pid=1234, host="another-host.example")
    with pytest.raises(checkpoint.CheckpointDirectoryInUseError,
                       match="process 1234 on host 'another-host.example'.*delete the lock file"):  # fmt: skip
        checkpoint.DirectoryLock(tmp_path).acquire()


# ----------------------------------------------------------------- two runs at once

#: One run: 12 microbatches of 2 examples, A=2: 6 update attempts, a checkpoint after each.
RACE = workers.Config(microbatches=12)
CLI_UPDATES = 4


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """One run of each kind in this process before any fork: the children inherit what a
    first update imports and initialises (seconds under load), so each race is about the
    runs. Returns how long each kind took here (s), to spread the start offsets over."""
    directory = tmp_path_factory.mktemp("warm")
    took: dict[str, float] = {}
    with open(os.devnull, "w") as quiet:
        saved = sys.stdout
        sys.stdout = quiet
        try:
            for attempt in range(2):  # the second is timed
                start = time.perf_counter()
                workers.train(workers.build(RACE), RACE, checkpoint_dir=directory / f"lib{attempt}",
                              checkpoint_every=1)  # fmt: skip
                took["library"] = time.perf_counter() - start
                start = time.perf_counter()
                cli.main(["train", "--updates", str(CLI_UPDATES), "--micro", "2", "--steps", "2",
                          "--examples", "16", "--checkpoint-dir", str(directory / f"cli{attempt}"),
                          "--checkpoint-every", "1", "--quiet"])  # fmt: skip
                took["cli"] = time.perf_counter() - start
        finally:
            sys.stdout = saved
    return took


def _library_run(directory: str, out: Any) -> None:
    attempts = []
    try:
        run = workers.build(RACE)
        ledger = workers.train(run, RACE, checkpoint_dir=directory, checkpoint_every=1,
                               on_update=lambda report: attempts.append(report.index))  # fmt: skip
        out.send(("ok", checkpoint.payload_checksum(run["model"].state_dict()), ledger.update_attempts))
    except Exception as exc:  # noqa: BLE001 (the parent judges it)
        out.send(("refused" if not attempts and any(r in str(exc) for r in REFUSED) else "error",
                  f"{type(exc).__name__}: {exc}", len(attempts)))  # fmt: skip


def _cli_run(directory: str, lr: str, out: Any) -> None:
    log = Path(directory).parent / f"cli-{os.getpid()}.err"
    sys.stdout, sys.stderr = open(os.devnull, "w"), open(log, "w")  # noqa: SIM115 (the child's own)
    code = cli.main(["train", "--updates", str(CLI_UPDATES), "--micro", "2", "--steps", "2",
                     "--examples", "16", "--lr", lr, "--checkpoint-dir", directory,
                     "--checkpoint-every", "1", "--quiet"])  # fmt: skip
    sys.stderr.flush()
    out.send((code, log.read_text()))


def _race(target: Any, args_a: tuple[Any, ...], args_b: tuple[Any, ...], offset_s: float) -> list[Any]:
    """Start run A, then run B ``offset_s`` later (each in its own process); both results."""
    pipes = [FORK.Pipe(duplex=False) for _ in range(2)]
    runs = [FORK.Process(target=target, args=(*args, pipe[1])) for args, pipe in zip((args_a, args_b), pipes, strict=True)]
    runs[0].start()
    time.sleep(offset_s)
    runs[1].start()
    results = []
    for run, (receive, _) in zip(runs, pipes, strict=True):
        assert receive.poll(120), "a run did not finish"
        results.append(receive.recv())
        run.join(30)
        assert run.exitcode == 0
    return results


def _assert_intact(directory: Path, attempts: int) -> dict[str, Any]:
    """The directory holds the winner's two newest checkpoints, intact, and nothing else
    of a run (no temporary file, no lock)."""
    assert checkpoint.list_checkpoints(directory) == [attempts, attempts - 1]
    states = [checkpoint.load_checkpoint(checkpoint.checkpoint_path(directory, n)) for n in (attempts, attempts - 1)]
    assert [s["ledger"]["update_attempts"] for s in states] == [attempts, attempts - 1]
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".")]
    assert leftovers == []
    return states[0]


@pytest.mark.concurrency
def test_two_library_runs_into_one_directory_one_is_refused_the_other_intact(
    tmp_path: Path, warm: dict[str, float]
) -> None:
    """20 pairs of al.train runs into one fresh directory, the second started at a random
    offset within 1.2 times one run's duration: one is refused before its first update
    (mostly by the lock; when it starts after the first run ended, because the directory
    holds checkpoints), the other's checkpoints are intact and its own."""
    rng = random.Random(25)
    by_lock = 0
    for repetition in range(20):
        directory = tmp_path / f"r{repetition}"
        offset = rng.uniform(0.0, 1.2 * warm["library"])
        results = _race(_library_run, (str(directory),), (str(directory),), offset)
        kinds = sorted(r[0] for r in results)
        assert kinds == ["ok", "refused"], (repetition, offset, results)
        by_lock += any("in use by another run" in str(r[1]) for r in results)
        winner = next(r for r in results if r[0] == "ok")
        newest = _assert_intact(directory, 6)
        assert checkpoint.payload_checksum(newest["model"]) == winner[1]  # the winner's weights
    print(f"library: {by_lock} of 20 refused by the lock (a run took {warm['library']:.2f} s)")
    assert by_lock >= 5  # the races did overlap


@pytest.mark.concurrency
def test_two_cli_runs_into_one_directory_one_is_refused_the_other_intact(
    tmp_path: Path, warm: dict[str, float]
) -> None:
    """20 pairs of `accumlab train` (cli.main in its own process) with different --lr into
    one directory, the second at a random offset within 1.2 times one run's duration: one
    exits 1 naming the holder (or 2: the directory already holds checkpoints, when it
    started after the first ended), the other's checkpoints are its own (its learning
    rate), and its own resume is accepted."""
    rng = random.Random(2025)
    by_lock = 0
    for repetition in range(20):
        directory = tmp_path / f"r{repetition}"
        offset = rng.uniform(0.0, 1.2 * warm["cli"])
        first, second = _race(_cli_run, (str(directory), "0.001"), (str(directory), "0.002"), offset)
        assert sorted((first[0], second[0])) in ([0, 1], [0, 2]), (repetition, offset, first, second)
        by_lock += 1 in (first[0], second[0])
        loser_log = (first if first[0] != 0 else second)[1]
        assert loser_log.count("\n") == 1 and loser_log.startswith("accumlab: error: --checkpoint-dir")
        assert any(r in loser_log for r in REFUSED), loser_log
        winner_lr = 1e-3 if first[0] == 0 else 2e-3
        newest = _assert_intact(directory, CLI_UPDATES)
        assert newest["settings"]["hyperparameters"][0]["lr"] == winner_lr
    print(f"cli: {by_lock} of 20 refused by the lock (a run took {warm['cli']:.2f} s)")
    assert by_lock >= 5
    # The winner's own resume is accepted.
    code = cli.main(["train", "--updates", str(CLI_UPDATES + 1), "--micro", "2", "--steps", "2",
                     "--examples", "16", "--lr", str(winner_lr), "--checkpoint-dir", str(directory),
                     "--checkpoint-every", "1", "--quiet", "--resume"])  # fmt: skip
    assert code == 0


def test_the_cli_names_the_holder_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ready, release = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold, args=(str(tmp_path / "ckpt"), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        code = cli.main(["train", "--updates", "2", "--micro", "2", "--steps", "2", "--examples", "8",
                         "--checkpoint-dir", str(tmp_path / "ckpt"), "--quiet"])  # fmt: skip
    finally:
        release.set()
        holder.join(30)
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and f"--checkpoint-dir {tmp_path / 'ckpt'} is in use by another run: process {holder.pid}" in err
    assert checkpoint.list_checkpoints(tmp_path / "ckpt") == []  # nothing written


def test_train_lets_the_directory_go_however_it_ends(tmp_path: Path) -> None:
    config = workers.Config()
    run = workers.build(config)

    def fail(report: al.UpdateReport) -> None:
        raise RuntimeError("a failing callback")

    with pytest.raises(RuntimeError, match="a failing callback"):
        workers.train(run, config, checkpoint_dir=tmp_path, checkpoint_every=1, on_update=fail)
    assert not (tmp_path / LOCK).exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no takeover warning: the lock was released, not left
        workers.train(workers.build(config), config, checkpoint_dir=tmp_path, resume=True)


def test_an_empty_lock_file_nobody_holds_is_taken_over(tmp_path: Path) -> None:
    """A run killed between creating the file and writing its name leaves it empty."""
    (tmp_path / LOCK).touch()
    with pytest.warns(UserWarning, match="left by a process that has not written its name yet"):
        with checkpoint.DirectoryLock(tmp_path) as held:
            assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid() == held.record["pid"]
    assert not (tmp_path / LOCK).exists()


# ----------------------------------------------------------------- corrupt records


@pytest.mark.parametrize("pid", [2**40, -5, 0, "12", True, None])
def test_a_corrupt_record_nobody_holds_is_taken_over_naming_the_file(tmp_path: Path, pid: Any) -> None:
    """A pid that is no process id (2**40 made os.kill raise OverflowError, a traceback)."""
    _write_record(tmp_path, pid=pid, host=socket.gethostname())
    with pytest.warns(UserWarning) as caught:
        with checkpoint.DirectoryLock(tmp_path) as held:
            assert json.loads((tmp_path / LOCK).read_text()) == held.record
    (warning,) = caught
    assert str(warning.message) == (
        f"checkpoint directory {tmp_path}: taking over the lock file {tmp_path / LOCK}, whose "
        f"record is corrupt (its pid {pid!r} is not a process id) and which no process holds; "
        "this run owns the directory now"
    )
    assert not (tmp_path / LOCK).exists()


def _hold_corrupt(directory: str, ready: Any, release: Any) -> None:
    """A child that flocks the lock file while its record names a pid no system has."""
    fd = os.open(Path(directory) / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, json.dumps({"pid": 2**40, "host": socket.gethostname()}).encode())
    lock_module.fcntl.flock(fd, lock_module.fcntl.LOCK_EX)
    ready.set()
    release.wait(30)


def test_a_corrupt_record_someone_holds_is_refused_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ready, release = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold_corrupt, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(checkpoint.CheckpointDirectoryInUseError) as info:
            checkpoint.DirectoryLock(tmp_path).acquire()
        code = cli.main(["train", "--updates", "1", "--micro", "2", "--steps", "2", "--examples",
                         "8", "--checkpoint-dir", str(tmp_path), "--quiet"])
    finally:
        release.set()
        holder.join(30)
    assert str(info.value).startswith(
        f"checkpoint directory {tmp_path} is in use by another run: a corrupt lock record (its "
        f"pid {2**40} is not a process id) (lock file {tmp_path / LOCK})"
    )
    assert code == 1
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith(f"accumlab: error: --checkpoint-dir {tmp_path} is in use")


# ----------------------------------------------------------------- a lock file deleted while its run lives


def _resume_beside(directory: str, started: Any, release: Any, out: Any) -> None:
    """Run B: takes the directory once A's lock file is gone, holds it until ``release``."""
    try:
        with checkpoint.DirectoryLock(directory) as held:
            started.set()
            release.wait(30)
            out.send(held.record)
    except Exception as exc:  # noqa: BLE001 (the parent judges it)
        started.set()
        out.send(f"{type(exc).__name__}: {exc}")


def test_a_deleted_lock_file_stops_the_run_at_its_next_write_and_spares_the_new_lock(tmp_path: Path) -> None:
    """Run A's lock file is deleted after its first checkpoint and run B takes the
    directory: A stops before its second checkpoint write with an error naming the lock
    file, and A's release (however it ends) leaves B's lock in place."""
    started, release = FORK.Event(), FORK.Event()
    receive, send = FORK.Pipe(duplex=False)
    other = FORK.Process(target=_resume_beside, args=(str(tmp_path), started, release, send))

    def delete_and_let_b_in(report: al.UpdateReport) -> None:
        if report.index == 0:
            (tmp_path / LOCK).unlink()
            other.start()
            assert started.wait(60)

    config = workers.Config(microbatches=8)
    try:
        with pytest.raises(checkpoint.CheckpointDirectoryInUseError) as info:
            workers.train(workers.build(config), config, checkpoint_dir=tmp_path, checkpoint_every=1,
                          on_update=delete_and_let_b_in)
        assert (tmp_path / LOCK).exists()  # B's lock survived A's release
        b_record = json.loads((tmp_path / LOCK).read_text())
    finally:
        release.set()
    assert receive.poll(30)
    assert receive.recv() == b_record and b_record["pid"] == other.pid
    other.join(30)
    assert str(info.value) == (
        f"checkpoint directory {tmp_path} is no longer this run's: its lock file {tmp_path / LOCK} "
        f"was replaced by another while the run lived (which names process {other.pid} on host "
        f"{socket.gethostname()!r}, started {b_record['started']}), so another run may be writing "
        "there; this run stopped before writing another checkpoint. Let one run at a time use the "
        "directory, then resume"
    )
    assert checkpoint.list_checkpoints(tmp_path) == [1]  # nothing written after the loss
    assert not (tmp_path / LOCK).exists()  # B let go of its own


def test_a_release_deletes_only_its_own_lock_file(tmp_path: Path) -> None:
    """This run's lock file is deleted and another process takes the directory: this
    run's release leaves that process's lock file (a new file at the same name) alone."""
    ready, release = FORK.Event(), FORK.Event()
    mine = checkpoint.DirectoryLock(tmp_path).acquire()
    (tmp_path / LOCK).unlink()
    holder = FORK.Process(target=_hold, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        mine.release()
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == holder.pid
    finally:
        release.set()
        holder.join(30)
    assert not (tmp_path / LOCK).exists()


# ----------------------------------------------------------------- a lock file that is no record


#: Bytes found in a lock file, and what the warning must say is wrong with them.
UNREADABLE = {
    "not UTF-8": (b"\xff\xfe lock", "its bytes are not UTF-8 text (byte 0xff at offset 0)"),
    "NUL bytes": (b"\x00" * 16, "it holds NUL bytes, the first at offset 0"),
    "a JSON string": (b'"12345"', "it holds a JSON str, not an object naming a pid and a host"),
    "not JSON": (b"zzz", "it is not JSON (Expecting value at character 0): b'zzz'"),
    "a JSON list": (b"[1, 2]", "it holds a JSON list, not an object naming a pid and a host"),
    "too long": (b"{" + b" " * 5000, "it holds over 4096 bytes, a record about 100"),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_a_lock_file_that_is_no_record_is_taken_over_naming_what_is_wrong(tmp_path: Path, case: str) -> None:
    """Not "a process that has not written its name yet ... killed?", which is what an
    empty file means: the warning names the file and what its bytes are."""
    content, why = UNREADABLE[case]
    (tmp_path / LOCK).write_bytes(content)
    with pytest.warns(UserWarning) as caught:
        with checkpoint.DirectoryLock(tmp_path) as held:
            assert json.loads((tmp_path / LOCK).read_text()) == held.record
    (warning,) = caught
    message = str(warning.message)
    assert message.startswith(f"checkpoint directory {tmp_path}: taking over the lock file "
                              f"{tmp_path / LOCK}, whose record is corrupt ({why}"), message
    assert message.endswith("and which no process holds; this run owns the directory now")
    assert "not written its name" not in message
    assert not (tmp_path / LOCK).exists()


def _hold_then_report(directory: str, ready: Any, overwritten: Any, out: Any) -> None:
    """A run that holds the lock until its file is overwritten, then checks it (as before a
    checkpoint write) and sends what it was told."""
    with checkpoint.DirectoryLock(directory) as held:
        ready.set()
        overwritten.wait(30)
        try:
            lock_module.check_still_held(held, directory)
            out.send("still held")
        except checkpoint.CheckpointDirectoryInUseError as exc:
            out.send(str(exc))


def test_a_live_runs_lock_overwritten_with_garbage_is_named_on_both_sides(tmp_path: Path) -> None:
    ready, overwritten = FORK.Event(), FORK.Event()
    receive, send = FORK.Pipe(duplex=False)
    holder = FORK.Process(target=_hold_then_report, args=(str(tmp_path), ready, overwritten, send))
    holder.start()
    try:
        assert ready.wait(30)
        (tmp_path / LOCK).write_bytes(b"zzz")  # the same file, its bytes replaced
        with pytest.raises(checkpoint.CheckpointDirectoryInUseError) as info:
            checkpoint.DirectoryLock(tmp_path).acquire()
    finally:
        overwritten.set()
    assert receive.poll(30)
    told = receive.recv()
    holder.join(30)
    corrupt = "a corrupt lock record (it is not JSON (Expecting value at character 0): b'zzz')"
    assert str(info.value).startswith(
        f"checkpoint directory {tmp_path} is in use by another run: {corrupt} (lock file {tmp_path / LOCK})")
    assert told.startswith(f"checkpoint directory {tmp_path} is no longer this run's: its lock file "
                           f"{tmp_path / LOCK} was overwritten while the run lived (it now names {corrupt}), ")


# ----------------------------------------------------------------- a lock path that is no regular file


def _not_a_lock(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """Put ``kind`` at the lock path of ``tmp_path / "ckpt"``; the words naming it."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    lock = directory / LOCK
    notes = tmp_path / "notes.txt"
    notes.write_text("a learner's notes\n")
    (tmp_path / "elsewhere").mkdir()
    if kind == "symlink to a file":
        lock.symlink_to(notes)
        return directory, f"a symlink to {notes}"
    if kind == "dangling symlink":
        lock.symlink_to(tmp_path / "nowhere")
        return directory, f"a symlink to {tmp_path / 'nowhere'}"
    if kind == "symlink to a directory":
        lock.symlink_to(tmp_path / "elsewhere")
        return directory, f"a symlink to {tmp_path / 'elsewhere'}"
    if kind == "symlink loop":
        lock.symlink_to(lock)
        return directory, f"a symlink to {lock}"
    if kind == "directory":
        lock.mkdir()
        return directory, "a directory"
    os.mkfifo(lock)
    return directory, "a FIFO (named pipe)"


NOT_A_LOCK = ["symlink to a file", "dangling symlink", "symlink to a directory", "symlink loop",
              "directory", "fifo"]


@pytest.mark.parametrize("kind", NOT_A_LOCK)
def test_a_lock_path_that_is_no_regular_file_is_named_and_never_written_through(tmp_path: Path, kind: str) -> None:
    """A symlink at the lock's name is never followed (a link to a learner's file had the
    lock record written into it, then the link deleted), a dangling one is not "other
    processes keep creating and deleting it", a directory or a loop is not a bare "Is a
    directory" or "Too many levels of symbolic links", and a FIFO not "Illegal seek" (or
    a read that never returns): one error naming the file, what it is and what to do."""
    directory, what = _not_a_lock(tmp_path, kind)
    before = os.lstat(directory / LOCK)
    with pytest.raises(OSError) as info:
        checkpoint.DirectoryLock(directory).acquire()
    assert info.value.strerror == (
        f"the lock file {directory / LOCK} is {what}, not a lock a run made (a run creates its "
        "lock itself, as a regular file, and never writes through a symlink: that would overwrite "
        f"the file it points to); remove it once no run uses checkpoint directory {directory}, and "
        "run again")
    after = os.lstat(directory / LOCK)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)  # left as it was
    assert (tmp_path / "notes.txt").read_text() == "a learner's notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "elsewhere", "notes.txt"]


def test_the_cli_names_a_symlinked_lock_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory, what = _not_a_lock(tmp_path, "symlink to a file")
    code = cli.main(["train", "--updates", "1", "--micro", "2", "--steps", "2", "--examples", "8",
                     "--checkpoint-dir", str(directory), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and err.startswith(f"accumlab: error: the lock file {directory / LOCK} is {what}, ")
    assert (tmp_path / "notes.txt").read_text() == "a learner's notes\n"


# ----------------------------------------------------------------- nothing left behind


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that is full: new (empty) files and directories can still be made,
    as on most file systems, but no byte can be written (``os.write``: ENOSPC)."""

    def no_space(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock_module.os, "write", no_space)


def test_a_full_disk_when_taking_the_lock_names_it_and_leaves_nothing(tmp_path: Path, full_disk: None) -> None:
    """The empty lock file it created is removed (the next run warned of "a process that
    has not written its name yet ... killed?"), and so are the directories it made."""
    directory = tmp_path / "runs" / "ckpt"
    with pytest.raises(OSError) as info:
        checkpoint.DirectoryLock(directory).acquire()
    assert info.value.errno == errno.ENOSPC
    assert info.value.strerror == f"cannot write the lock file {directory / LOCK}: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_naming_the_lock_file(tmp_path: Path, full_disk: None, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "ckpt"
    code = cli.main(["train", "--updates", "1", "--micro", "2", "--steps", "2", "--examples", "8",
                     "--checkpoint-dir", str(directory), "--quiet"])
    assert code == 1
    assert capsys.readouterr().err == (
        f"accumlab: error: cannot write the lock file {directory / LOCK}: No space left on device\n")
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_directory_it_made(tmp_path: Path) -> None:
    config = workers.Config()

    def fail(report: al.UpdateReport) -> None:
        raise RuntimeError("a failing callback")

    with pytest.raises(RuntimeError, match="a failing callback"):
        workers.train(workers.build(config), config, checkpoint_dir=tmp_path / "runs" / "ckpt", on_update=fail)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()  # one the user made stays, empty or not
    with pytest.raises(RuntimeError, match="a failing callback"):
        workers.train(workers.build(config), config, checkpoint_dir=tmp_path / "mine", on_update=fail)
    assert [p.name for p in tmp_path.iterdir()] == ["mine"] and not any((tmp_path / "mine").iterdir())


def test_a_nul_byte_in_checkpoint_dir_names_the_argument_and_the_path() -> None:
    run = workers.build(workers.Config())

    def never() -> Any:
        raise AssertionError("data was read")
        yield

    with pytest.raises(ValueError) as info:
        workers.train(run, workers.Config(), never(), checkpoint_dir="runs/a\0b")
    assert str(info.value) == ("checkpoint_dir 'runs/a\\x00b' holds a NUL byte (at position 6), "
                               "which no file system takes in a path; give a directory without one")


def test_a_live_runs_lock_replaced_by_a_symlink_to_it_is_no_longer_its_own(tmp_path: Path) -> None:
    """The lock file moved away and a symlink to it put at its name: the same file through
    the link, but not at the name the run owns (another run would not see it there); the
    run stops before its next write, naming the symlink, and leaves both alone."""
    held = checkpoint.DirectoryLock(tmp_path).acquire()
    (tmp_path / "elsewhere").mkdir()
    moved = tmp_path / "elsewhere" / "lock"
    os.rename(tmp_path / LOCK, moved)
    (tmp_path / LOCK).symlink_to(moved)
    try:
        with pytest.raises(checkpoint.CheckpointDirectoryInUseError) as info:
            lock_module.check_still_held(held, tmp_path)
    finally:
        held.release()
    assert f"its lock file {tmp_path / LOCK} was replaced by a symlink to {moved} while the run lived" in str(info.value)
    assert (tmp_path / LOCK).is_symlink() and json.loads(moved.read_text()) == held.record
