"""``python -m ampkit ...`` runs the ``ampkit`` command."""

from __future__ import annotations

import sys

from ampkit.tools.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
