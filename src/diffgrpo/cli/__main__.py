"""``python -m diffgrpo.cli ...`` (what ``torchrun -m diffgrpo.cli`` runs): the ``diffgrpo`` command line."""
import sys

from .app import main

if __name__ == "__main__":
    sys.exit(main())
