"""``python -m offcore`` runs the command line (:mod:`offcore.cli`)."""

import sys

from offcore.cli import main

sys.exit(main())
