"""``python -m diffgrpo ...``: the ``diffgrpo`` command line."""
import sys

from .cli import main

sys.exit(main())
