"""Hypothesis profiles for the suite.

``kvgeom-ci`` (the default) derandomizes every property test: CI draws the same examples on every
run, so a red run is reproducible and a green one does not depend on luck. ``kvgeom-explore``
(``KVGEOM_HYPOTHESIS_PROFILE=kvgeom-explore pytest``) draws fresh examples each run, for hunting
bugs locally. A test's own ``@settings`` still sets its example count; ``kvgeom fuzz`` seeds its
runs itself.
"""

from __future__ import annotations

import os

try:
    from hypothesis import settings
except ImportError:  # the property tests skip themselves without the testing extra
    pass
else:
    settings.register_profile("kvgeom-ci", derandomize=True, deadline=None, print_blob=True)
    settings.register_profile("kvgeom-explore", derandomize=False, deadline=None, print_blob=True)
    settings.load_profile(os.environ.get("KVGEOM_HYPOTHESIS_PROFILE", "kvgeom-ci"))
