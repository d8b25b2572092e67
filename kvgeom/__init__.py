"""kvgeom: plan and check KV-cache transfers between engines whose cache geometries differ.

Pure arithmetic on integers and numpy arrays: importing kvgeom never imports torch or nixl. The
subpackages are layers, each importing only the ones below it (docs/design.md §2); engines may
have pipeline stages, DCP token shards and replicas (``Topology``, docs/design.md §10)::

    errors <- arith <- values <- {planning, lowering, checking} <- {building, show} <- tools

This face re-exports the public names; ``kvgeom_nixl`` (the executor) imports only these and the
faces of the subpackages.
"""

from __future__ import annotations

from .arith import Slice, TokenShard, layer_partition, owned_slice, sources
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
)
from .lowering import tile_bytes
from .planning import STRATEGIES, CostModel, Pair, coalesce, coalesce_zeros, plan_pair, plan_transfer
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
    RankCoords,
    Rearrange,
    Region,
    Request,
    SectionPlacement,
    StateGroupGeometry,
    StateLayout,
    StateSection,
    StateSlots,
    StateSpec,
    StateView,
    Topology,
    TransferPlan,
    Zeros,
    incompatibilities,
    pairable,
)

__version__ = "0.1.0"

__all__ = [
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
    "PlanError",
    "RankCoords",
    "Rearrange",
    "Region",
    "Report",
    "Request",
    "RequestError",
    "SchemaError",
    "SectionPlacement",
    "Slice",
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
    "Zeros",
    "coalesce",
    "coalesce_zeros",
    "draw",
    "dump_pair_file",
    "fresh_request",
    "incompatibilities",
    "layer_partition",
    "load_pair_file",
    "owned_slice",
    "pairable",
    "plan_pair",
    "plan_transfer",
    "simulate",
    "sources",
    "tile_bytes",
    "verify",
]
