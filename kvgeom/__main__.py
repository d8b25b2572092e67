"""``python -m kvgeom``: the same command line as ``kvgeom`` (see :mod:`kvgeom.cli`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
