"""``python -m rolloutd``: the same as the ``rolloutd`` command."""
import sys

from rolloutd.daemons.cli import main

sys.exit(main())
