"""The ``accumlab`` command a user can trust: resume refuses changed settings,
``--record`` never replaces what its path is, every failure is one line, Ctrl-C says
where to resume from, and ``--help``/``--version`` read as plain text."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from accumlab.cli import SETTINGS_FILE, build_parser, main

TINY = ["train", "--micro", "2", "--steps", "2", "--updates", "1", "--examples", "8", "--quiet"]
SMALL = ["train", "--micro", "2", "--steps", "2", "--examples", "24", "--quiet"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m accumlab ARGS`` in a fresh process (exit code, stderr as a user sees them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return subprocess.run([sys.executable, "-m", "accumlab", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def one_line(err: str) -> str:
    """The single stderr line of a failed command (no traceback)."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


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


# --- item 3: a resume never runs or records a setting other than the checkpoint's ------------


@pytest.mark.parametrize(
    ("flag", "value", "saved"),
    [
        ("--lr", "0.1", "0.003"),
        ("--clip", "0.5", "none"),
        ("--seed", "1", "0"),
        ("--examples", "20", "24"),
        ("--precision", "bf16", "fp32"),
        ("--last-window", "drop", "update"),
    ],
)
def test_resume_refuses_a_changed_setting_naming_it(ckpt_run, tmp_path, capsys, flag, value, saved):
    record = tmp_path / "resumed.json"
    code = main([*SMALL, "--updates", "4", "--checkpoint-dir", str(ckpt_run), "--resume",
                 flag, value, "--record", str(record)])
    assert code == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("accumlab: error: ")
    assert f"{flag} {value}" in line and f"{flag} {saved}" in line, line
    assert "--checkpoint-dir" in line  # the other way out: a new run directory
    assert not record.exists()  # nothing recorded for a run that did not happen


def test_resume_with_the_same_settings_still_runs(ckpt_run, tmp_path, capsys):
    record = tmp_path / "resumed.json"
    assert main([*SMALL, "--updates", "3", "--checkpoint-dir", str(ckpt_run), "--resume",
                 "--record", str(record)]) == 0
    written = json.loads(record.read_text())
    assert written["update_attempts"] == 3
    assert written["extra"]["learning_rate"] == written["lr_first"] == written["lr_last"] == 3e-3


def test_resume_without_the_settings_file_checks_what_the_checkpoint_stores(ckpt_run, capsys):
    """A directory from an older accumlab (no settings file): the learning rate and the
    clipping are read from the checkpoint itself."""
    (ckpt_run / SETTINGS_FILE).unlink()
    for flag, value, saved in (("--lr", "0.1", "0.003"), ("--clip", "0.5", "none")):
        assert main([*SMALL, "--updates", "4", "--checkpoint-dir", str(ckpt_run), "--resume",
                     flag, value]) == 2
        line = one_line(capsys.readouterr().err)
        assert f"{flag} {value}" in line and f"{flag} {saved}" in line, line


def test_a_resume_with_no_checkpoint_yet_takes_the_new_settings(tmp_path, capsys):
    """Killed before the first checkpoint: --resume starts fresh, with the flags given now."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / SETTINGS_FILE).write_text(json.dumps({"--lr": 0.003}))
    assert main([*TINY, "--lr", "0.01", "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    assert json.loads((ckpt / SETTINGS_FILE).read_text())["--lr"] == 0.01


# --- item 6: --record writes through a symlink and refuses what is not a regular file -----


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


def test_record_fifo_from_the_command_line(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result = cli(*TINY, "--record", str(fifo), "--force")
    assert result.returncode == 1
    assert "not a regular file" in one_line(result.stderr)
    assert fifo.is_fifo()


# --- the record and the checkpoints must not collide (checked before training) -------------


@pytest.mark.parametrize("where", ["same", "checkpoint_name", "settings_file", "above"])
def test_record_and_checkpoint_dir_that_collide_are_refused(tmp_path, capsys, no_training, where):
    ckpt = tmp_path / "ckpt"
    record = {
        "same": ckpt,
        "checkpoint_name": ckpt / "checkpoint-00000001-rank0.pt",
        "settings_file": ckpt / SETTINGS_FILE,
        "above": tmp_path,
    }[where]
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


# --- item 7: a corrupt newest checkpoint is one line, never a traceback -------------------


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_corrupt_newest_checkpoint_is_one_line(tmp_path, damage):
    ckpt = tmp_path / "ckpt"
    first = cli(*SMALL, "--updates", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1")
    assert first.returncode == 0, first.stderr
    newest = ckpt / "checkpoint-00000002-rank0.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    result = cli(*SMALL, "--updates", "3", "--checkpoint-dir", str(ckpt), "--resume")
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    # the library falls back to the previous checkpoint, and the command says so in one line
    assert result.returncode == 0, result.stderr
    assert lines[0].startswith("accumlab: warning: ") and newest.name in lines[0], lines
    assert "3 update attempts" in result.stdout


def test_no_intact_checkpoint_is_one_line(monkeypatch, capsys):
    """The library warns once per damaged checkpoint it skips, then raises one error
    naming them all: the command prints that error alone (exit 1: not a usage error)."""
    import warnings

    import accumlab.driver

    class CorruptCheckpointError(ValueError):
        pass

    whys = [f"checkpoint ckpt/checkpoint-0000000{n}-rank0.pt is not intact: the file is empty"
            for n in (3, 2)]

    def all_damaged(*args, **kwargs):
        for why in whys:
            warnings.warn(f"{why}; resuming from the one before it instead", UserWarning, stacklevel=2)
        warnings.warn("something else the user should see", UserWarning, stacklevel=2)
        raise CorruptCheckpointError("no intact checkpoint in ckpt: " + "; ".join(whys))

    monkeypatch.setattr(accumlab.driver, "train", all_damaged)
    assert main(TINY) == 1
    assert capsys.readouterr().err.splitlines() == [
        "accumlab: warning: something else the user should see",
        "accumlab: error: no intact checkpoint in ckpt: " + "; ".join(whys),
    ]


def test_every_checkpoint_damaged_from_the_command_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert cli(*SMALL, "--updates", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1").returncode == 0
    for name in ("checkpoint-00000001-rank0.pt", "checkpoint-00000002-rank0.pt"):
        (ckpt / name).write_bytes(b"")
    result = cli(*SMALL, "--updates", "3", "--checkpoint-dir", str(ckpt), "--resume")
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert line.startswith("accumlab: error: ") and "checkpoint-00000001" in line and "checkpoint-00000002" in line


def test_a_library_warning_is_one_line(monkeypatch, capsys):
    import warnings

    import accumlab.driver

    def warn_then_fail(*args, **kwargs):
        warnings.warn("checkpoint-00000002-rank0.pt is corrupt\n(truncated); using the one before",
                      UserWarning, stacklevel=2)
        raise RuntimeError("PytorchStreamReader failed reading zip archive:\nfailed finding central directory")

    monkeypatch.setattr(accumlab.driver, "train", warn_then_fail)
    assert main(TINY) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
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


# --- smaller -------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--lr", "--clip"])
@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0"])
def test_non_finite_or_non_positive_hyper_parameters_are_refused(capsys, no_training, flag, value):
    assert main([*TINY, flag, value]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{flag} must be a positive, finite number" in line and value in line


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


def test_ctrl_c_without_checkpoints_is_one_line(monkeypatch, capsys):
    import accumlab.driver

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(accumlab.driver, "train", interrupted)
    assert main(TINY) == 130
    line = one_line(capsys.readouterr().err)
    assert line == "accumlab: interrupted; no checkpoint was written (no --checkpoint-dir)"


def test_ctrl_c_names_the_last_checkpoint(tmp_path):
    """A real SIGINT in the middle of a run: exit 130, one line naming the newest checkpoint
    and how to continue from it."""
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "accumlab", "train", "--micro", "2", "--steps", "2", "--updates",
         "100000", "--quiet", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(ckpt.glob("checkpoint-*-rank0.pt")):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
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

