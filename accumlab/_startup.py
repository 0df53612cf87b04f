"""Ctrl-C while the ``accumlab`` command starts: one line and exit code 130.

The command spends its first second or more importing torch, inside ``import accumlab``:
the console script runs ``from accumlab.cli import main`` and ``python -m accumlab``
imports the package before its ``__main__``, so no ``try`` in the CLI surrounds that
import, and a ``KeyboardInterrupt`` there would end in a traceback and exit code -2. So the
package calls :func:`guard_command_start` before anything else: when this process is the
``accumlab`` command, Ctrl-C until :func:`command_started` (the first line of
``cli.main``) prints one line and exits with 130 at once. In any other process (a
notebook, a script that imports accumlab) it changes nothing. Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

#: What the command prints when Ctrl-C comes while it starts.
INTERRUPTED_LINE = "accumlab: interrupted while starting; nothing was run"


def is_command_start(argv: list[str] | None = None, orig_argv: list[str] | None = None) -> bool:
    """Whether this process is starting the ``accumlab`` command: its console script
    (``sys.argv[0]`` is the script, named ``accumlab``), or ``python -m accumlab`` (while
    Python locates the module, ``sys.argv[0]`` is ``"-m"``, as the docs of ``-m`` say; the
    interpreter's own arguments name the module)."""
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    first = argv[0] if argv else ""
    if first == "-m":
        return "accumlab" in orig_argv or "-maccumlab" in orig_argv
    name = first.replace("\\", "/").rsplit("/", 1)[-1].lower()  # a Windows path too
    return name in ("accumlab", "accumlab.exe", "accumlab-script.py")


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    # os._exit, not an exception: an exception raised here can land anywhere in torch's
    # import, including code that swallows it (a __del__, a callback: "Exception ignored"),
    # and the start-up has nothing to clean up (no file is written before cli.main runs).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.write(2, (INTERRUPTED_LINE + "\n").encode())  # no Python-level stream: no lock held
    os._exit(130)


def guard_command_start() -> None:
    """In the ``accumlab`` command, make Ctrl-C print :data:`INTERRUPTED_LINE` and exit
    130 until :func:`command_started`. Only where Ctrl-C would raise KeyboardInterrupt
    now (Python's handler in the main thread): an ignored SIGINT (a background job) stays
    ignored."""
    if is_command_start() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, _exit_at_once)
        except ValueError:  # not the main thread: leave Python's handler
            pass


def command_started() -> None:
    """From here on Ctrl-C raises KeyboardInterrupt again, for the command to report."""
    if signal.getsignal(signal.SIGINT) is _exit_at_once:
        signal.signal(signal.SIGINT, signal.default_int_handler)
