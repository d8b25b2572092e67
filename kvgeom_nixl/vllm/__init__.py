"""kvgeom inside vLLM: a KV connector built on kvgeom, and a conformance run of vLLM's own connector.

This subpackage imports vLLM; nothing else in kvgeom or kvgeom_nixl imports it, so ``import
kvgeom_nixl`` works without vLLM installed. ``KvgeomConnector`` (docs/design.md §15) is loaded on
first use, so ``kvgeom_nixl.vllm.<module>`` can be imported without importing the connector::

    KVTransferConfig(kv_connector="KvgeomConnector", kv_connector_module_path="kvgeom_nixl.vllm",
                     kv_role="kv_both", kv_buffer_device="cpu")
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvgeomConnector", "KvgeomConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
