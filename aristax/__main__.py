"""``python -m aristax ...`` runs the ``aristax`` command."""

from aristax.cli import entry

entry()
