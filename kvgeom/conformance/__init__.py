"""The conformance kit: check a connector's own descriptor pairs and zero ranges with the simulator
(docs/design.md §10.4).

A connector hands over what it posts (copy rows or vLLM-style READs over descriptor tables, plus
its receive step: the pages it permutes, as rearranges, and the byte ranges it zeroes) and its
policy for D tokens past M (``beyond_computed``); kvgeom turns them into a plan, runs the reference
simulator (docs/design.md §7) and reports every finding in the connector's terms: its descriptor
ids, the logical block, the tokens and the layer. It sits above both the simulator and the values
(layer 4, beside building and show).
"""

from __future__ import annotations

from ..checking.content import BEYOND_COMPUTED_POLICIES
from .check import (
    ConformanceReport,
    ConnectorViolation,
    check_connector,
)
from .receive import VLLM_PAGE_ORDERS, page_tail_zeros, regroup_rearrange
from .rows import (
    MAX_CONNECTOR_ROWS,
    MAX_DESCRIPTORS,
    ConnectorRows,
    DescriptorTable,
    Read,
    Unresolved,
    rows_from_descriptors,
)

__all__ = [
    "ConformanceReport",
    "ConnectorViolation",
    "check_connector",
    "ConnectorRows",
    "DescriptorTable",
    "Read",
    "Unresolved",
    "rows_from_descriptors",
    "MAX_CONNECTOR_ROWS",
    "MAX_DESCRIPTORS",
    "BEYOND_COMPUTED_POLICIES",
    "regroup_rearrange",
    "page_tail_zeros",
    "VLLM_PAGE_ORDERS",
]
