"""``python -m hdet`` (and ``torchrun ... -m hdet train``) runs the CLI."""

import sys

from .cli import main

sys.exit(main())
