"""``python -m accumlab``: the ``accumlab`` command comes with the course, not the library."""

import sys

sys.exit(
    "accumlab: the `accumlab` command (train the course's tiny GPT, `accumlab env`) comes with "
    "the course: install accumlab-course (`make lab`, or pip install ./course from a checkout) "
    "and run `accumlab` or `python -m accumlab_course`"
)
