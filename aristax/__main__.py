"""``python -m aristax ...`` runs the ``aristax`` command."""

import sys

from aristax.cli import main

sys.exit(main())
