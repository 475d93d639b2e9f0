"""``python -m hdet`` (and ``torchrun ... -m hdet train``) runs the CLI."""

from .app.cli import entry

entry()
