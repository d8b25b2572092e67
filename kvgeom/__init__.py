"""kvgeom: plan and check KV-cache transfers between engines whose cache geometries differ.

Pure arithmetic on integers and numpy arrays: importing kvgeom never imports torch or nixl.
"""

from __future__ import annotations

from typing import Any as _Any

from .coalesce import coalesce, coalesce_zeros
from .errors import GeometryError, IncompatibleGeometry, InternalError, KvGeomError, PlanError, RequestError
from .geometry import (
    AttentionGroupGeometry,
    AttentionView,
    EngineGeometry,
    PageLayout,
    Region,
    SectionPlacement,
    StateGroupGeometry,
    StateLayout,
    StateView,
)
from .model import AttentionSpec, GroupKind, ModelSpec, StateSection, StateSpec
from .pair import Compatibility, Pair, fresh_request, incompatibilities, pairable
from .plan import Copies, Rearrange, TransferPlan, Zeros
from .planner import STRATEGIES, CostModel, plan_pair, plan_transfer
from .request import BlockList, GroupRequest, Request, StateSlots
from .serialize import SCHEMA_VERSION, SchemaError, dump_pair_file, load_pair_file
from .shard import Slice, owned_slice, sources
from .simulate import Memory, Report, Violation, ViolationKind, verify
from .tiles import tile_bytes

__version__ = "0.1.0"


def draw(plan: TransferPlan, pair: Pair, request: Request, **options: _Any) -> _Any:
    """One picture of ``request``'s transfer (a matplotlib ``Figure``; the ``notebook`` extra).

    D blocks as rows of token cells per layer and head group, coloured by source P rank and
    block, zeroed bytes hatched, untouched bytes blank; ``side="prefill"`` shows which D rank reads
    each P cell. Options are those of :func:`kvgeom.drawing.draw`. matplotlib is imported only
    when this is called, so ``import kvgeom`` stays light.
    """
    from .drawing import draw as _draw

    return _draw(plan, pair, request, **options)

# ``kvgeom.simulate`` stays the module (the reference simulator); its ``simulate`` function is
# ``kvgeom.simulate.simulate`` and :func:`verify` plans and simulates in one call.
__all__ = [
    "SCHEMA_VERSION",
    "STRATEGIES",
    "SchemaError",
    "dump_pair_file",
    "load_pair_file",
    "tile_bytes",
    "CostModel",
    "Memory",
    "Report",
    "Violation",
    "ViolationKind",
    "coalesce",
    "draw",
    "coalesce_zeros",
    "plan_pair",
    "plan_transfer",
    "verify",
    "AttentionGroupGeometry",
    "AttentionSpec",
    "AttentionView",
    "BlockList",
    "Compatibility",
    "Copies",
    "EngineGeometry",
    "GeometryError",
    "GroupKind",
    "GroupRequest",
    "IncompatibleGeometry",
    "InternalError",
    "KvGeomError",
    "ModelSpec",
    "PageLayout",
    "Pair",
    "PlanError",
    "Rearrange",
    "Region",
    "Request",
    "RequestError",
    "SectionPlacement",
    "Slice",
    "StateGroupGeometry",
    "StateLayout",
    "StateSection",
    "StateSlots",
    "StateSpec",
    "StateView",
    "TransferPlan",
    "Zeros",
    "fresh_request",
    "incompatibilities",
    "owned_slice",
    "pairable",
    "sources",
]
