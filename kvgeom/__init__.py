"""kvgeom: plan and check KV-cache transfers between engines whose cache geometries differ.

Pure arithmetic on integers and numpy arrays: importing kvgeom never imports torch or nixl. The
subpackages are layers, each importing only the ones below it (docs/design.md §2); engines may
have pipeline stages, DCP token shards and replicas (``Topology``, docs/design.md §11)::

    errors <- arith <- values <- {planning, lowering, checking} <- {building, show, conformance} <- tools

This face re-exports the public names; ``kvgeom_nixl`` (the executor) imports only these and the
faces of the subpackages.

Logging: every module logs to ``logging.getLogger(__name__)``, children of the ``kvgeom`` logger
(debug: pair checks and strategy decisions; warning: fallbacks). The package adds only a
``NullHandler``; configure ``logging`` in your application to see them.
"""

from __future__ import annotations

import logging

from .arith import Slice, TokenShard, layer_partition, owned_slice, sources
from .building import fresh_request, request_from_block_tables, verify
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
    StagingCapacityError,
    value_text,
)
from .lowering import tile_bytes
from .planning import (
    DEFAULT_BUDGET,
    DEFAULT_STAGING_BYTES,
    STRATEGIES,
    CompiledPair,
    CostModel,
    Pair,
    PlanBudget,
    PlanEstimate,
    check_budget,
    coalesce,
    coalesce_zeros,
    estimate_plan,
    min_staging_bytes,
    plan_pair,
    plan_reference,
    plan_transfer,
)
from .show import draw
from .tools import SCHEMA_VERSION, dump_pair_file, load_pair_file
from .values import (
    AttentionGroupGeometry,
    AttentionSpec,
    AttentionView,
    BlockList,
    CheckedEngines,
    Chunk,
    ChunkPiece,
    Compatibility,
    Copies,
    EngineGeometry,
    GroupKind,
    GroupRequest,
    LayerTensors,
    ModelSpec,
    Note,
    NoteKind,
    PageLayout,
    RankCoords,
    Rearrange,
    Region,
    Request,
    RequestShape,
    SectionPlacement,
    StagingStep,
    StateGroupGeometry,
    StateLayout,
    StateSection,
    StateSlots,
    StateSpec,
    StateView,
    Topology,
    TransferPlan,
    WireCopies,
    Zeros,
    incompatibilities,
    pairable,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BUDGET",
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
    "CompiledPair",
    "Copies",
    "CostModel",
    "EngineGeometry",
    "CheckedEngines",
    "GeometryError",
    "GroupKind",
    "GroupRequest",
    "IncompatibleGeometry",
    "InternalError",
    "KvGeomError",
    "LayerTensors",
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
    "RankCoords",
    "Rearrange",
    "Region",
    "Report",
    "Request",
    "RequestError",
    "RequestShape",
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
    "TokenShard",
    "Topology",
    "TransferPlan",
    "Violation",
    "ViolationKind",
    "WireCopies",
    "Zeros",
    "coalesce",
    "coalesce_zeros",
    "check_budget",
    "draw",
    "dump_pair_file",
    "estimate_plan",
    "fresh_request",
    "incompatibilities",
    "layer_partition",
    "load_pair_file",
    "min_staging_bytes",
    "owned_slice",
    "pairable",
    "plan_pair",
    "plan_reference",
    "plan_transfer",
    "request_from_block_tables",
    "simulate",
    "sources",
    "tile_bytes",
    "value_text",
    "verify",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
