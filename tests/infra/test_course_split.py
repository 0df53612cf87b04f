"""The library and the course are two distributions: what the seam promises a user."""

from __future__ import annotations

import subprocess
import sys


def test_python_m_accumlab_says_where_the_command_is_in_one_line():
    done = subprocess.run([sys.executable, "-m", "accumlab"], capture_output=True, text=True)
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert "accumlab-course" in line and "python -m accumlab_course" in line


def test_the_course_command_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "accumlab_course", "--version"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("0.1.0")
