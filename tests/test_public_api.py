"""The public surface is exactly ``__all__`` (for both packages), and every name in it resolves."""

from __future__ import annotations

import importlib
import inspect

import pytest


@pytest.mark.parametrize("package", ["kvgeom", "kvgeom_nixl"])
def test_all_is_the_public_surface(package: str) -> None:
    if package == "kvgeom_nixl":
        from nixl_env import NIXL_API
        pytest.importorskip(NIXL_API, reason="kvgeom_nixl needs the nixl extra")
    mod = importlib.import_module(package)
    exported = set(mod.__all__)
    assert len(exported) == len(mod.__all__), "duplicates in __all__"
    public = {n for n in dir(mod) if not n.startswith("_") and not inspect.ismodule(getattr(mod, n))
              and n != "annotations"}
    assert exported == public
    for name in exported:
        assert getattr(mod, name) is not None
