"""The ``accumlab`` command in a fresh process, as a user's shell starts it.

A child that is to see Ctrl-C gets SIGINT's default action back before it starts:
Python keeps an inherited ignored SIGINT ignored (no KeyboardInterrupt), so a test run
started with SIGINT ignored (``nohup``, ``trap '' INT``, a background job, a
provisioning script) would otherwise send its Ctrl-C to a process that cannot see it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def run(*args: str, timeout: float = 120, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m accumlab_course ARGS`` to its end (exit code, stdout and stderr as a user sees
    them); ``prefix`` runs it as ``python PREFIX... ARGS`` instead (a wrapper script)."""
    command = [sys.executable, *(prefix or ["-m", "accumlab_course"]), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def one_line(err: str) -> str:
    """The single stderr line of a failed command (no traceback)."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]
