"""kvgeom inside vLLM: a KV connector built on kvgeom, and a conformance run of vLLM's own connector.

This subpackage imports vLLM; nothing else in kvgeom or kvgeom_nixl imports it, so ``import
kvgeom_nixl`` works without vLLM installed.
"""

__all__: list[str] = []
