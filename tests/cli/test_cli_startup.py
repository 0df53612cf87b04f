"""What the ``accumlab`` command does before it runs anything: every integer
flag is checked at parse time, naming the flag and its range, and Ctrl-C while torch
imports is one line and exit code 130, from the console script and from ``python -m``."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from accumlab import _startup
from accumlab.cli import MAX_SEED, main

TINY = ["train", "--micro", "2", "--steps", "2", "--updates", "1", "--examples", "8", "--quiet"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}

# --- integer flags: the range is checked by the parser, with the flag's name --------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["train", "--seed", str(2**64)], "--seed"), (["train", "--seed", "-1"], "--seed"),
     (["train", "--seed", "1.5"], "--seed"), (["train", "--micro", "0"], "--micro"),
     (["train", "--steps", "-3"], "--steps"), (["train", "--updates", "0"], "--updates"),
     (["train", "--examples", "0"], "--examples"), (["train", "--examples", "-1"], "--examples"),
     (["train", "--checkpoint-dir", "x", "--checkpoint-every", "0"], "--checkpoint-every"),
     (["plan", "--effective", "0", "--micro", "4"], "--effective"),
     (["plan", "--effective", "64", "--micro", "-4"], "--micro"),
     (["plan", "--effective", "64", "--micro", "4", "--dp", "0"], "--dp")],
)  # fmt: skip
def test_an_integer_flag_out_of_range_is_a_usage_error_naming_it(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    value = argv[argv.index(flag) + 1]
    last = err.splitlines()[-1]
    assert f"error: argument {flag}: must be a whole number" in last and repr(value) in last
    if flag == "--seed":
        assert f"from 0 to {MAX_SEED}" in last and MAX_SEED == 2**64 - 1


def test_the_seed_range_is_what_torch_takes():
    """The ends of the range run; one past the top is what torch itself cannot take."""
    import torch

    for seed in (0, MAX_SEED):
        torch.Generator().manual_seed(seed)
        assert main([*TINY, "--seed", str(seed)]) == 0
    with pytest.raises((RuntimeError, ValueError)):  # "Overflow when unpacking long long"
        torch.manual_seed(MAX_SEED + 1)


@pytest.mark.parametrize(("flag", "value"), [("--seed", str(2**64)), ("--seed", "-1"),
                                           ("--nproc", "0"), ("--micro", "0"),
                                           ("--examples", "-5"), ("--steps", "0")])
def test_the_ddp_example_checks_its_integer_flags_the_same_way(flag, value, capsys):
    """examples/ddp_train.py (run by notebook 04) takes the CLI's checks: a bad value is a
    usage error naming the flag before any process is spawned."""
    spec = importlib.util.spec_from_file_location(
        "ddp_train", Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.parse([]).seed == 0
    with pytest.raises(SystemExit) as exit_:
        example.parse([flag, value])
    assert exit_.value.code == 2
    assert f"error: argument {flag}: must be a whole number" in capsys.readouterr().err


# --- Ctrl-C during start-up ---------------------------------------------------------------


def entry_points() -> dict[str, list[str]]:
    """The two ways to start the command: ``python -m accumlab`` and the console script
    (beside this interpreter when accumlab is installed, as `make lab` does)."""
    found = {"python -m accumlab": [sys.executable, "-m", "accumlab"]}
    script = Path(sys.executable).parent / ("accumlab.exe" if os.name == "nt" else "accumlab")
    if script.is_file():
        found["accumlab"] = [str(script)]
    return found


class Started:
    """A command in a subprocess, with Python's import timing on (each completed import is
    a stderr line ``import time: ... | module``): ``importing_torch`` is set at the first
    torch module imported, i.e. the start-up is inside ``import accumlab``, importing
    torch. (Before accumlab's first line runs, Python's own start-up, its ``site`` and an
    editable install's finder take 20 ms to a few hundred on a loaded machine: a SIGINT
    there is Python's, which no package can catch.)"""

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**ENV, "PYTHONPROFILEIMPORTTIME": "1"},
        )  # fmt: skip
        self.importing_torch = threading.Event()
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if line.startswith("import time:"):
                if re.search(r"\|\s+torch(\.|$)", line.rstrip("\n")):
                    self.importing_torch.set()
            else:
                self.lines.append(line.rstrip("\n"))

    def finish(self, timeout: float = 120) -> tuple[int, list[str]]:
        try:
            code = self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        self.reader.join(timeout=30)
        return code, self.lines


@pytest.mark.parametrize("offset", [0.0, 0.02, 0.05, 0.15, 0.3, 0.6, 1.0, 2.0])
def test_ctrl_c_while_the_command_starts_is_one_line_and_130(offset):
    """SIGINT ``offset`` seconds after the start-up began importing torch (which takes
    about 0.3 to 2.5 s): from both entry points, exit 130 and one stderr line, never a
    traceback. At the early offsets the line is the start-up's; at the later ones the
    run may have begun, and the line is the run's own."""
    # 2,000 updates of one example each: many seconds, the run is never over by then
    runs = {name: Started([*command, "train", "--micro", "1", "--steps", "1", "--updates",
                           "100000", "--quiet"])
            for name, command in entry_points().items()}  # fmt: skip
    for name, run in runs.items():
        assert run.importing_torch.wait(timeout=120), name
    time.sleep(offset)
    for run in runs.values():
        run.process.send_signal(signal.SIGINT)
    for name, run in runs.items():
        code, lines = run.finish()
        assert code == 130 and len(lines) == 1, (name, code, lines)
        assert lines[0] == _startup.INTERRUPTED_LINE or lines[0].startswith(
            "accumlab: interrupted; no checkpoint was written"), (name, lines)
        if offset <= 0.05:  # torch takes longer than that to import, on any machine
            assert lines[0] == _startup.INTERRUPTED_LINE, (name, lines)


def test_an_ignored_ctrl_c_stays_ignored():
    """A background job started with SIGINT ignored: the start-up must not turn Ctrl-C
    back on (neither its own line nor a KeyboardInterrupt), before or after main runs."""
    run = subprocess.Popen(
        [sys.executable, "-m", "accumlab", *TINY], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=ENV,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        for _ in range(6):
            time.sleep(0.25)
            if run.poll() is None:
                run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 0, err
    assert "interrupted" not in err and "| update_attempts | 1 |" in out


def test_only_the_command_is_guarded():
    """``import accumlab`` in any other program (a notebook, a script) leaves Ctrl-C as
    Python's KeyboardInterrupt."""
    probe = ("import signal, accumlab; "
             "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=ENV, check=True).stdout  # fmt: skip
    assert out.strip() == "True"


@pytest.mark.parametrize(
    ("argv", "orig_argv", "command"),
    [(["-m"], ["python", "-m", "accumlab", "train"], True),
     (["-m"], ["python", "-X", "importtime", "-maccumlab"], True),
     (["-m"], ["python", "-m", "accumlab.course"], False),
     (["/venv/bin/accumlab", "train"], ["/venv/bin/python", "/venv/bin/accumlab"], True),
     (["C:\\venv\\Scripts\\accumlab.exe"], ["python"], True),
     (["-c"], ["python", "-c", "import accumlab"], False),
     (["/home/me/train.py"], ["python", "/home/me/train.py"], False),
     ([""], ["python"], False), ([], [], False)],
)  # fmt: skip
def test_which_processes_are_the_command(argv, orig_argv, command):
    assert _startup.is_command_start(argv, orig_argv) is command
