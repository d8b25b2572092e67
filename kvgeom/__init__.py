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
    PlanError,
    RequestError,
    SchemaError,
    StagingCapacityError,
)
from .lowering import tile_bytes
from .planning import (
    DEFAULT_STAGING_BYTES,
    STRATEGIES,
    CostModel,
    Pair,
    coalesce,
    coalesce_zeros,
    min_staging_bytes,
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
    Chunk,
    ChunkPiece,
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
    SectionPlacement,
    StagingStep,
    StateGroupGeometry,
    StateLayout,
    StateSection,
    StateSlots,
    StateSpec,
    StateView,
    TransferPlan,
    WireCopies,
    Zeros,
    incompatibilities,
    pairable,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "SCHEMA_VERSION",
    "STRATEGIES",
    "AttentionGroupGeometry",
    "AttentionSpec",
    "AttentionView",
    "BlockList",
    "Chunk",
    "ChunkPiece",
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
    "PlanError",
    "Rearrange",
    "Region",
    "Report",
    "Request",
    "RequestError",
    "SchemaError",
    "SectionPlacement",
    "Slice",
    "StagingCapacityError",
    "StagingStep",
    "StateGroupGeometry",
    "StateLayout",
    "StateSection",
    "StateSlots",
    "StateSpec",
    "StateView",
    "TransferPlan",
    "Violation",
    "ViolationKind",
    "WireCopies",
    "Zeros",
    "coalesce",
    "coalesce_zeros",
    "draw",
    "dump_pair_file",
    "fresh_request",
    "incompatibilities",
    "load_pair_file",
    "min_staging_bytes",
    "owned_slice",
    "pairable",
    "plan_pair",
    "plan_transfer",
    "simulate",
    "sources",
    "tile_bytes",
    "verify",
]
