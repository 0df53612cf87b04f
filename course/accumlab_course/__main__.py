"""``python -m accumlab_course`` runs the ``accumlab`` command."""

import sys

from .cli import main

sys.exit(main())
