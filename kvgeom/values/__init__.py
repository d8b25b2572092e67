"""Frozen value classes, validated when built: the model, one engine's geometry, a request, a plan, a pair.

Everything above this layer (planning, checking, lowering, building, showing, tools) exchanges these values.
"""

from __future__ import annotations

from .blocks import (
    CopyBlock,
    blocks_to_copies,
)
from .builder import (
    engine_fields,
)
from .coverage import (
    coverage_problems,
    needed_range,
)
from .engine import (
    EngineGeometry,
    engine_html,
    engine_line,
    engine_repr,
)
from .engine_checks import (
    MAX_PAGE_VECTORS,
    EngineFields,
    validate_engine,
)
from .fields import (
    as_tuple,
    attr_int,
    check_int,
    int_tuple,
    is_int,
    nonneg_int,
    pos_int,
)
from .layout import (
    AttentionGroupGeometry,
    AttentionView,
    GroupGeometry,
    PageLayout,
    Region,
    SectionPlacement,
    StateGroupGeometry,
    StateLayout,
    StateView,
    section_placements,
    state_layout,
)
from .model import (
    AttentionSpec,
    GroupKind,
    GroupSpec,
    ModelSpec,
    StateSection,
    StateSpec,
    default_layer_order,
)
from .notes import (
    Note,
    NoteKind,
    as_notes,
)
from .pair import (
    Compatibility,
    EnginePair,
    incompatibilities,
    pairable,
)
from .plan import (
    COPY_COLUMNS,
    ZERO_COLUMNS,
    Copies,
    Rearrange,
    TransferPlan,
    Zeros,
    plan_html,
    plan_pair_bytes,
    plan_rank_rows,
    plan_repr,
)
from .request import (
    BlockList,
    GroupRequest,
    Request,
    SideBlocks,
    StateSlots,
    request_html,
    request_repr,
)
from .staging import (
    STAGING_SIDES,
    WIRE_COLUMNS,
    Chunk,
    ChunkPiece,
    StagingStep,
    WireCopies,
)
from .tensors import (
    AXIS_NAMES,
    LayerTensors,
    TensorFacts,
    parse_axes,
    tensor_facts,
    tensor_fields,
)
from .text import (
    MAX_RANK_ROWS,
    cut,
    format_bytes,
    format_ids,
    html_block,
    html_table,
    text_table,
)
from .topology import (
    RankCoords,
    Topology,
)

__all__ = [
    "engine_fields",
    "needed_range",
    "coverage_problems",
    "EngineGeometry",
    "engine_line",
    "engine_repr",
    "engine_html",
    "MAX_PAGE_VECTORS",
    "EngineFields",
    "validate_engine",
    "is_int",
    "check_int",
    "attr_int",
    "pos_int",
    "nonneg_int",
    "as_tuple",
    "int_tuple",
    "Region",
    "PageLayout",
    "AttentionView",
    "StateLayout",
    "StateView",
    "AttentionGroupGeometry",
    "StateGroupGeometry",
    "GroupGeometry",
    "SectionPlacement",
    "section_placements",
    "state_layout",
    "GroupKind",
    "AttentionSpec",
    "StateSection",
    "StateSpec",
    "GroupSpec",
    "ModelSpec",
    "default_layer_order",
    "Topology",
    "RankCoords",
    "NoteKind",
    "Note",
    "as_notes",
    "EnginePair",
    "Compatibility",
    "incompatibilities",
    "pairable",
    "Copies",
    "Zeros",
    "Rearrange",
    "TransferPlan",
    "COPY_COLUMNS",
    "ZERO_COLUMNS",
    "plan_repr",
    "plan_html",
    "plan_rank_rows",
    "plan_pair_bytes",
    "CopyBlock",
    "blocks_to_copies",
    "StagingStep",
    "WireCopies",
    "WIRE_COLUMNS",
    "ChunkPiece",
    "Chunk",
    "STAGING_SIDES",
    "BlockList",
    "StateSlots",
    "SideBlocks",
    "GroupRequest",
    "Request",
    "request_repr",
    "request_html",
    "AXIS_NAMES",
    "LayerTensors",
    "TensorFacts",
    "parse_axes",
    "tensor_facts",
    "tensor_fields",
    "format_ids",
    "format_bytes",
    "text_table",
    "html_table",
    "html_block",
    "cut",
    "MAX_RANK_ROWS",
]
