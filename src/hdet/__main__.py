"""``python -m hdet`` (and ``torchrun ... -m hdet train``) runs the CLI."""

import sys

from .app.cli import main

sys.exit(main())
