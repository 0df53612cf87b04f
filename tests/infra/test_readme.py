"""README.md: about 200 lines, the two commands, and the loop in its first screen, runnable:
its block trains one window and asserts the accumulated gradient is the full batch's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_short_and_gives_the_two_commands():
    assert len(README.splitlines()) <= 200
    assert "make lab" in README and "make test" in README


def test_the_loop_is_in_the_first_screen_and_runs(tmp_path):
    start = README.index("## The loop")
    block = re.search(r"```python\n(.*?)```", README[start:], re.S)
    first_line = README[: start + block.start()].count("\n") + 1
    assert first_line <= 50, first_line  # a reader meets the loop before scrolling far
    code = block.group(1)
    assert "optimizer.step()" in code and "assert check.ok" in code
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    error = float(re.search(r"max relative error (\S+) ", run.stdout).group(1))
    assert 1e-9 < error < 1e-6  # what the comment says: float32 rounding, near 1e-7


def test_every_local_link_resolves():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (REPO / target).exists(), target
