"""The ``accumlab`` command in another process: a fresh interpreter, as a user's shell
starts it (:func:`start`), or a child forked from the tests' own process
(:func:`forked`), which starts in milliseconds instead of seconds (torch is imported
already) and has limits of its own (``ulimit -f``).

A fresh child that is to see Ctrl-C gets SIGINT's default action back before it starts:
Python keeps an inherited ignored SIGINT ignored (no KeyboardInterrupt), so a test run
started with SIGINT ignored (``nohup``, ``trap '' INT``, a background job, a
provisioning script) would otherwise send its Ctrl-C to a process that cannot see it.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
from typing import Any

#: The environment every command runs in: one thread, no progress bar.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def start(*args: str, ignore_ctrl_c: bool = False, stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    """``python -m accumlab_course ARGS``, started with SIGINT's default action (Python turns it
    into KeyboardInterrupt), or with it ignored (``ignore_ctrl_c``: a background job)."""
    handler = signal.SIG_IGN if ignore_ctrl_c else signal.SIG_DFL
    return subprocess.Popen([sys.executable, "-m", "accumlab_course", *args], text=True, env=ENV,
                            stdout=stdout, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, handler))


def one_line(err: str) -> str:
    """The single stderr line of a failed command (no traceback)."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _main_in_child(argv: list[str], file_size_limit: int | None, out: str, err: str) -> None:
    if file_size_limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    random.seed(0)  # its state is in every checkpoint: the same bytes in every child
    from accumlab_course.cli import main

    with open(out, "w") as sys.stdout, open(err, "w") as sys.stderr:
        code = main(argv)
    sys.exit(code)


def forked(*args: str, file_size_limit: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``accumlab ARGS`` (``cli.main``) in a child forked from this process, to its end:
    its exit code, stdout and stderr. ``file_size_limit``: the child's ``ulimit -f`` in
    bytes (a write past it fails with EFBIG). Python's ``random`` is seeded in the child,
    so that the checkpoints it writes have the same size in every child (a checkpoint
    holds that generator's state, whose pickled size varies with the state)."""
    with tempfile.TemporaryDirectory() as logs:
        out, err = os.path.join(logs, "out"), os.path.join(logs, "err")
        child = multiprocessing.get_context("fork").Process(
            target=_main_in_child, args=(list(args), file_size_limit, out, err))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise TimeoutError(f"accumlab {' '.join(args)} did not end within {timeout} s")
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(["accumlab", *args], child.exitcode, o.read(), e.read())
