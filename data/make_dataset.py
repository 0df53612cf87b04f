"""Generate the small instruction data set shipped with accumlab.

The file ships inside the package as ``course/accumlab_course/instructions.jsonl`` (package
data, so an installed wheel carries it). Each line is one JSON object with the keys ``id``
(0..N-1), ``prompt`` and ``response``. The tasks are character puzzles a tiny
character-level model picks up quickly (reverse, upper-case, repeat, count, sort),
and the string lengths are spread widely on purpose: response lengths run from 1 to
60 characters, so an example's share of the supervised tokens varies a lot. That is
what makes token weighting (notebook 02) visible.

Usage (standard library only, deterministic for a given seed):

    python data/make_dataset.py           # write course/accumlab_course/instructions.jsonl
    python data/make_dataset.py --check   # exit 1 if the committed file is stale
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

SEED = 1234
NUM_EXAMPLES = 2000
MAX_SEQ_CHARS = 127  # prompt + response + one end-of-sequence token
LETTERS = "abcdefghijklmnopqrstuvwxyz"
OUTPUT_PATH = Path(__file__).resolve().parents[1] / "course" / "accumlab_course" / "instructions.jsonl"


def _word(rng: random.Random, min_len: int, max_len: int) -> str:
    """A random lower-case string whose length is uniform on [min_len, max_len]."""
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, 1, 50)
    return f"reverse: {s}\n", s[::-1]


def _upper(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, 1, 50)
    return f"upper: {s}\n", s.upper()


def _sort(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, 1, 50)
    return f"sort: {s}\n", "".join(sorted(s))


def _repeat(rng: random.Random) -> tuple[str, str]:
    k = rng.randint(2, 6)
    s = _word(rng, 1, 10)
    return f"repeat {k}: {s}\n", s * k


def _count(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, 1, 40)
    return f"count: {s}\n", str(len(s))


TASKS: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _reverse,
    _upper,
    _sort,
    _repeat,
    _count,
)


def generate(num_examples: int = NUM_EXAMPLES, seed: int = SEED) -> list[str]:
    """Return the data set as JSON lines (each ending in a newline), in id order.

    The result depends only on ``num_examples`` and ``seed``.
    """
    rng = random.Random(seed)
    lines = []
    for i in range(num_examples):
        prompt, response = rng.choice(TASKS)(rng)
        if len(prompt) + len(response) + 1 > MAX_SEQ_CHARS:
            raise AssertionError(f"example {i} is longer than {MAX_SEQ_CHARS} characters")
        record = {"id": i, "prompt": prompt, "response": response}
        lines.append(json.dumps(record) + "\n")
    return lines


def check(path: Path = OUTPUT_PATH) -> bool:
    """True when the file at ``path`` is exactly what :func:`generate` produces."""
    if not path.exists():
        return False
    return path.read_text(encoding="utf-8") == "".join(generate())


def summary(lines: list[str]) -> str:
    """Min/median/max of prompt and response lengths (in characters), as text."""
    records = [json.loads(line) for line in lines]
    out = [f"{len(records)} examples"]
    for key in ("prompt", "response"):
        lengths = [len(r[key]) for r in records]
        out.append(
            f"{key} length (chars): min {min(lengths)}, "
            f"median {statistics.median(lengths):g}, max {max(lengths)}"
        )
    totals = [len(r["prompt"]) + len(r["response"]) + 1 for r in records]
    out.append(f"sequence length incl. end token: max {max(totals)}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file differs")
    args = parser.parse_args(argv)
    if args.check:
        if check():
            print(f"{OUTPUT_PATH.name} is up to date")
            return 0
        print(f"{OUTPUT_PATH.name} differs from the generator; run python data/make_dataset.py")
        return 1
    lines = generate()
    with open(OUTPUT_PATH, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(lines)
    print(f"wrote {OUTPUT_PATH} ({OUTPUT_PATH.stat().st_size} bytes)")
    print(summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
