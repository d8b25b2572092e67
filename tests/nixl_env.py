"""The module name of NIXL's Python API on this machine, for ``pytest.importorskip``: the ``nixl``
meta package's, or one CUDA flavour's installed alone (``nixl-cu13``, ``nixl-cu12``), in the
order ``kvgeom_nixl.agent.NIXL_PACKAGES`` tries them. Imports nothing heavy."""

from __future__ import annotations

import importlib.util


def _api_module() -> str:
    for pkg in ("nixl", "nixl_cu13", "nixl_cu12"):
        try:
            if importlib.util.find_spec(pkg) is not None:
                return f"{pkg}._api"
        except (ImportError, ValueError):  # a module set to None in sys.modules, or without a spec
            continue
    return "nixl._api"  # none installed: importorskip skips on this name


NIXL_API = _api_module()
