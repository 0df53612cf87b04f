"""Fail in seconds, with one line, when PyTorch's wheel index cannot be reached.

``make lab TORCH_INDEX=cpu`` runs this before pip: without it pip retries an unreachable
index for a minute or more and prints a warning per retry. Standard library only.

    python tools/reach_index.py https://download.pytorch.org/whl/cpu
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def reachable(url: str, timeout: float = 15.0) -> str | None:
    """None if ``url``'s torch page answers within ``timeout`` seconds, else the reason."""
    page = url.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(page, timeout=timeout) as response:  # noqa: S310 (http(s) only)
            response.read(1)
    except (urllib.error.URLError, OSError, ValueError) as error:
        return str(getattr(error, "reason", error))
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/reach_index.py INDEX_URL", file=sys.stderr)
        return 2
    reason = reachable(argv[0])
    if reason is None:
        return 0
    print(f"cannot reach PyTorch's wheel index {argv[0]} ({reason}): check the network or "
          "proxy and run make again, or set TORCH_INDEX to a mirror you can reach",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
