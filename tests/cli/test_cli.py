import json

import pytest

from accumlab_course.cli import main


def test_plan_prints_the_product(capsys):
    assert main(["plan", "--effective", "64", "--micro", "4", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 examples/microbatch × 8 microbatches/window × 2 replicas = 64" in out


def test_plan_rejects_an_indivisible_batch(capsys):
    assert main(["plan", "--effective", "30", "--micro", "4"]) == 2
    err = capsys.readouterr().err
    assert "not a multiple" in err and "micro_batch_size" in err


def test_env_reports_torch(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "cuda" in out


def test_train_writes_a_consistent_record(tmp_path, capsys):
    path = tmp_path / "run.json"
    code = main(
        ["train", "--micro", "2", "--steps", "3", "--updates", "4", "--examples", "40",
         "--quiet", "--record", str(path)]
    )
    assert code == 0
    record = json.loads(path.read_text())
    assert record["update_attempts"] == 4
    assert record["updates_applied"] == 4
    assert record["microbatches"] == 12  # 4 windows × 3 microbatches
    assert record["examples"] == 24  # 12 microbatches × 2 examples
    assert record["effective_batch_size"] == 6


def test_train_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--micro", "0", "--quiet"])
    assert exit_.value.code == 2
    assert "argument --micro: must be a whole number, at least 1" in capsys.readouterr().err


def test_unknown_precision_is_refused_by_argparse():
    with pytest.raises(SystemExit):
        main(["train", "--precision", "fp8"])


# --- accumlab env --check -------------------------------------------------------------------


def test_env_check_runs_an_accumulation_window(capsys):
    assert main(["env", "--check"]) == 0
    out = capsys.readouterr().out
    for key in ("python", "torch", "threads", "cuda", "gloo", "ipywidgets"):
        assert any(line.startswith(key + " ") for line in out.splitlines()), key
    assert "accumulation window on cpu" in out and out.rstrip().endswith(" s")
    assert "all checks passed" in out


def test_env_check_fails_with_one_clear_line(monkeypatch, capsys):
    import accumlab.checks

    def wrong(*args, **kwargs):  # an accumulated gradient 1% off the full batch
        return accumlab.checks.GradientComparison(max_abs={"w": 0.01}, relative={"w": 0.01})

    monkeypatch.setattr(accumlab.checks, "compare_gradients", wrong)
    assert main(["env", "--check"]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "all checks passed" not in captured.out
    assert captured.err.splitlines() == [
        "accumlab: check failed: on cpu the accumulated gradient differs from the full batch "
        "by 1.0e-02 (relative), above 1e-05"
    ]


def test_check_devices_follow_what_torch_reports():
    from accumlab_course.environment import check_devices

    assert check_devices({"gpus": [], "mps": False}) == ["cpu"]
    assert check_devices({"gpus": ["A", "B"], "mps": False}) == ["cpu", "cuda:0", "cuda:1"]
    assert check_devices({"gpus": [], "mps": True}) == ["cpu", "mps"]


# --- accumlab train --record ----------------------------------------------------------------

TINY = ["train", "--micro", "2", "--steps", "2", "--updates", "1", "--examples", "8", "--quiet"]


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if the command starts training (it must refuse before that)."""
    import accumlab.driver

    def refuse(*args, **kwargs):
        raise AssertionError("training started although the record path was refused")

    monkeypatch.setattr(accumlab.driver, "train", refuse)


def test_record_holds_the_run_settings_in_a_new_directory(tmp_path, capsys):
    path = tmp_path / "runs" / "nested" / "run.json"
    assert main([*TINY, "--seed", "3", "--lr", "0.01", "--record", str(path)]) == 0
    extra = json.loads(path.read_text())["extra"]
    assert extra["seed"] == 3 and extra["learning_rate"] == 0.01 and extra["data_examples"] == 8
    assert sorted(p.name for p in path.parent.iterdir()) == ["run.json"]  # no temp file left
    assert f"run record written to {path}" in capsys.readouterr().out


def test_record_alone_goes_under_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--record"]) == 0
    (written,) = (tmp_path / "runs").iterdir()
    assert written.name.startswith("train-") and written.suffix == ".json"
    assert json.loads(written.read_text())["update_attempts"] == 1


def test_existing_record_is_kept_unless_force(tmp_path, capsys, monkeypatch):
    path = tmp_path / "run.json"
    path.write_text("earlier run\n")
    import accumlab.driver

    real_train = accumlab.driver.train
    monkeypatch.setattr(accumlab.driver, "train", lambda *a, **k: pytest.fail("trained first"))
    assert main([*TINY, "--record", str(path)]) == 1
    assert path.read_text() == "earlier run\n"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and "--force" in err
    monkeypatch.setattr(accumlab.driver, "train", real_train)
    assert main([*TINY, "--record", str(path), "--force"]) == 0
    assert json.loads(path.read_text())["update_attempts"] == 1


@pytest.mark.parametrize("where", ["under_a_file", "a_directory"])
def test_unwritable_record_is_refused_before_training(tmp_path, capsys, no_training, where):
    blocker = tmp_path / "blocker"
    if where == "under_a_file":
        blocker.write_text("")
        path = blocker / "run.json"  # its "directory" is a regular file
    else:
        blocker.mkdir()
        path = blocker
    assert main([*TINY, "--record", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("accumlab: error: ") and err.count("\n") == 1
    assert "Traceback" not in err
    assert ("is a file, not a directory" if where == "under_a_file" else "is a directory") in err


def test_empty_record_path_is_a_usage_error(capsys, no_training):
    assert main([*TINY, "--record", ""]) == 2
    assert "--record needs a file path" in capsys.readouterr().err


def test_command_line_error_is_one_line_without_traceback(tmp_path):
    import subprocess
    import sys

    (tmp_path / "blocker").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "accumlab_course", *TINY, "--record", str(tmp_path / "blocker" / "r.json")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr


# --- checkpoints and resume ------------------------------------------------------------


def test_train_resumes_from_its_checkpoint_to_the_straight_runs_record(tmp_path, capsys):
    """Stopped after 3 update attempts (as a kill would leave it), the same command with
    --resume ends with the record of the run trained straight through to 5."""
    common = ["train", "--micro", "2", "--steps", "2", "--examples", "24", "--quiet"]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1", "--resume"]
    assert main([*common, "--updates", "5", "--record", str(tmp_path / "straight.json")]) == 0
    assert main([*common, "--updates", "3", *ckpt]) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    assert main([*common, "--updates", "5", *ckpt, "--record", str(tmp_path / "resumed.json")]) == 0
    assert "resuming from " + str(tmp_path / "ckpt" / "checkpoint-00000003-rank0.pt") in capsys.readouterr().out
    straight = json.loads((tmp_path / "straight.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["update_attempts"] == 5
    assert resumed == straight


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-dir", ""], "--checkpoint-dir is an empty path"),
    ],
)
def test_checkpoint_flags_are_checked_before_training(flags, message, capsys, no_training):
    """The checkpoint layer's own check, in the command's words (its flags)."""
    assert main([*TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_used_checkpoint_dir_needs_resume(tmp_path, capsys):
    (tmp_path / "checkpoint-00000004-rank0.pt").write_bytes(b"")
    assert main([*TINY, "--checkpoint-dir", str(tmp_path)]) == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "already holds checkpoints" in line and "pass --resume" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000004-rank0.pt"]
