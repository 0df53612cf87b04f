import json

import pytest

from accumlab.cli import main


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
    assert main(["train", "--micro", "0", "--quiet"]) == 2
    assert "micro_batch_size must be at least 1" in capsys.readouterr().err


def test_unknown_precision_is_refused_by_argparse():
    with pytest.raises(SystemExit):
        main(["train", "--precision", "fp8"])
