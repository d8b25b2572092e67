"""kvgeom: plan and check KV-cache transfers between engines whose cache geometries differ.

Pure arithmetic on integers and numpy arrays: importing kvgeom never imports torch or nixl. The
subpackages are layers, each importing only the ones below it (docs/design.md §2)::

    errors <- arith <- values <- {planning, lowering, checking} <- {building, show} <- tools

This face re-exports the public names; ``kvgeom_nixl`` (the executor) imports only these and the
faces of the subpackages.
"""

from __future__ import annotations

from .arith import Slice, owned_slice, sources
from .building import fresh_request, verify
from .checking import Memory, Report, Violation, ViolationKind, simulate
from .errors import (
    GeometryError,
    IncompatibleGeometry,
    InternalError,
    KvGeomError,
    PlanBudgetExceeded,
    PlanError,
    RequestError,
    SchemaError,
    value_text,
)
from .lowering import tile_bytes
from .planning import (
    DEFAULT_BUDGET,
    STRATEGIES,
    CostModel,
    Pair,
    PlanBudget,
    PlanEstimate,
    coalesce,
    coalesce_zeros,
    estimate_plan,
    plan_pair,
    plan_transfer,
)
from .show import draw
from .tools import SCHEMA_VERSION, dump_pair_file, load_pair_file
from .values import (
    AttentionGroupGeometry,
    AttentionSpec,
    AttentionView,
    BlockList,
    Compatibility,
    Copies,
    EngineGeometry,
    EnginePair,
    GroupKind,
    GroupRequest,
    ModelSpec,
    Note,
    NoteKind,
    PageLayout,
    Rearrange,
    Region,
    Request,
    RequestShape,
    SectionPlacement,
    StateGroupGeometry,
    StateLayout,
    StateSection,
    StateSlots,
    StateSpec,
    StateView,
    TransferPlan,
    Zeros,
    incompatibilities,
    pairable,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BUDGET",
    "SCHEMA_VERSION",
    "STRATEGIES",
    "AttentionGroupGeometry",
    "AttentionSpec",
    "AttentionView",
    "BlockList",
    "Compatibility",
    "Copies",
    "CostModel",
    "EngineGeometry",
    "EnginePair",
    "GeometryError",
    "GroupKind",
    "GroupRequest",
    "IncompatibleGeometry",
    "InternalError",
    "KvGeomError",
    "Memory",
    "ModelSpec",
    "Note",
    "NoteKind",
    "PageLayout",
    "Pair",
    "PlanBudget",
    "PlanBudgetExceeded",
    "PlanEstimate",
    "PlanError",
    "Rearrange",
    "Region",
    "Report",
    "Request",
    "RequestError",
    "RequestShape",
    "SchemaError",
    "SectionPlacement",
    "Slice",
    "StateGroupGeometry",
    "StateLayout",
    "StateSection",
    "StateSlots",
    "StateSpec",
    "StateView",
    "TransferPlan",
    "Violation",
    "ViolationKind",
    "Zeros",
    "coalesce",
    "coalesce_zeros",
    "draw",
    "dump_pair_file",
    "estimate_plan",
    "fresh_request",
    "incompatibilities",
    "load_pair_file",
    "owned_slice",
    "pairable",
    "plan_pair",
    "plan_transfer",
    "simulate",
    "sources",
    "tile_bytes",
    "value_text",
    "verify",
]
