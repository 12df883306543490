"""``python -m replayssm ...`` runs the CLI."""

import sys

from replayssm.cli import main

sys.exit(main())
