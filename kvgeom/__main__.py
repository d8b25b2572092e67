"""``python -m kvgeom``: the same command line as ``kvgeom`` (see :mod:`kvgeom.tools.cli`)."""

from __future__ import annotations

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
